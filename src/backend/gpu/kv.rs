//! The GPU's KV caches: the blocks of one pool (backend/kv_pool.rs) in two device buffers, keys
//! and values `[blocks, KV_BLOCK, width]` bf16, and per cache a block table on the device that
//! the attention kernels follow (kernels/common/kv_rows.h). A cache's table keeps its address
//! while the cache grows within its capacity, so a recorded decode step stays valid: growing only
//! writes the new entries.

use std::sync::Arc;

use super::{kv_bytes, CopySpan, DeviceBuffer, Runtime};
use crate::backend::kv_pool::{blocks_for, BlockList, KvPool, KV_BLOCK};
use crate::{Error, Result};

pub(super) struct GpuKvPool {
    keys: DeviceBuffer,
    values: DeviceBuffer,
    width: usize,
    books: Arc<KvPool>,
}

impl GpuKvPool {
    pub(super) fn new(rt: &Arc<dyn Runtime>, width: usize, blocks: usize) -> Result<Arc<Self>> {
        let books = KvPool::new(blocks)?;
        let bytes = kv_bytes(blocks * KV_BLOCK, width)?.max(2);
        let alloc = |what: &str| {
            DeviceBuffer::new(rt, bytes).map_err(|e| {
                Error::Device(format!("the KV cache's {what} ({blocks} blocks of {KV_BLOCK} positions, {bytes} bytes) do not fit: {e}"))
            })
        };
        Ok(Arc::new(GpuKvPool { keys: alloc("keys")?, values: alloc("values")?, width, books }))
    }

    pub(super) fn width(&self) -> usize {
        self.width
    }

    pub(super) fn books(&self) -> &Arc<KvPool> {
        &self.books
    }
}

pub struct GpuKvCache {
    pool: Arc<GpuKvPool>,
    blocks: BlockList,
    /// Entry i (i32) names the block of positions i·KV_BLOCK..; the first `blocks.ids().len()`
    /// are written.
    table: DeviceBuffer,
    /// Positions the table maps (a multiple of KV_BLOCK).
    capacity: usize,
    /// A saved piece's positions (`Backend::save_kv`); 0 for a sequence's cache.
    len: usize,
}

impl GpuKvCache {
    /// An empty cache of `pool` whose table maps `capacity` positions.
    pub(super) fn new(rt: &Arc<dyn Runtime>, pool: &Arc<GpuKvPool>, capacity: usize) -> Result<Self> {
        let entries = blocks_for(capacity).max(1);
        Ok(GpuKvCache {
            pool: pool.clone(),
            blocks: BlockList::new(&pool.books),
            table: DeviceBuffer::new(rt, entries * 4)?,
            capacity: entries * KV_BLOCK,
            len: 0,
        })
    }

    pub(super) fn width(&self) -> usize {
        self.pool.width
    }

    pub(super) fn keys(&self) -> u64 {
        self.pool.keys.ptr
    }

    pub(super) fn values(&self) -> u64 {
        self.pool.values.ptr
    }

    pub(super) fn table(&self) -> u64 {
        self.table.ptr
    }

    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// Positions the blocks held can take.
    pub(super) fn held(&self) -> usize {
        self.blocks.positions()
    }

    /// Bytes of the blocks held.
    pub(super) fn bytes(&self) -> usize {
        2 * kv_bytes(self.held(), self.width()).unwrap_or(usize::MAX / 2)
    }

    /// Takes blocks until `positions` fit (all or nothing: `Error::CacheFull`), writing their
    /// table entries; a table too short for them is replaced by a longer one. Returns whether the
    /// table moved (a recording that points at the old one is stale).
    pub(super) fn grow(&mut self, rt: &Arc<dyn Runtime>, positions: usize) -> Result<bool> {
        if positions <= self.held() {
            return Ok(false);
        }
        let moved = positions > self.capacity;
        if moved {
            let entries = blocks_for(positions).next_power_of_two().max(4);
            self.table = DeviceBuffer::new(rt, entries * 4)?;
            self.capacity = entries * KV_BLOCK;
        }
        let before = self.blocks.grow(positions)?;
        let from = if moved { 0 } else { before };
        let entries: Vec<u8> = self.blocks.ids()[from..].iter().flat_map(|id| id.to_le_bytes()).collect();
        rt.upload(self.table.ptr + 4 * from as u64, &entries)?;
        Ok(moved)
    }

    /// The copies that move positions `from..from + len` of `src` to `to..` of `dst` (both
    /// holding their blocks): one span per run that stays within a block of each, keys and values.
    pub(super) fn spans(src: &GpuKvCache, from: usize, dst: &GpuKvCache, to: usize, len: usize, out: &mut Vec<CopySpan>) -> Result<()> {
        let width = src.width();
        if dst.width() != width {
            return Err(Error::InvalidArgument(format!("a KV copy from width {width} into width {}", dst.width())));
        }
        if from + len > src.held() || to + len > dst.held() {
            return Err(Error::InvalidArgument(format!(
                "a KV copy of {len} positions from {from} (of {} held) to {to} (of {} held)",
                src.held(),
                dst.held()
            )));
        }
        let row = kv_bytes(1, width)? as u64;
        let at = |cache: &GpuKvCache, p: usize| (u64::from(cache.blocks.ids()[p / KV_BLOCK]) * KV_BLOCK as u64 + (p % KV_BLOCK) as u64) * row;
        let mut done = 0;
        while done < len {
            let (s, d) = (from + done, to + done);
            let run = (KV_BLOCK - s % KV_BLOCK).min(KV_BLOCK - d % KV_BLOCK).min(len - done);
            let bytes = run * row as usize;
            out.push(CopySpan { dst: dst.keys() + at(dst, d), src: src.keys() + at(src, s), bytes });
            out.push(CopySpan { dst: dst.values() + at(dst, d), src: src.values() + at(src, s), bytes });
            done += run;
        }
        Ok(())
    }
}
