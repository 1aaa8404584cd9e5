//! The KV pool: every sequence's keys and values, in blocks of `KV_BLOCK` positions of one
//! attention layer, taken from one pool sized at load (`Backend::set_kv_pool`) and shared by all
//! sequences. A cache takes blocks as its sequence grows and gives them back when it is dropped,
//! so memory follows the positions in use, not `parallel` times the context size. This module
//! keeps the books (which blocks are free); the backends keep the bytes (the GPU one stores the
//! blocks in two device buffers and gives each cache a block table on the device, which the
//! kernels follow: kernels/common/kv_rows.h).

use std::sync::{Arc, Mutex};

use crate::{Error, Result};

/// Positions per block (KV_BLOCK in kernels/common/kv_rows.h).
pub const KV_BLOCK: usize = 64;

/// Blocks needed for `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(KV_BLOCK)
}

/// Which of a pool's blocks are free.
pub struct KvPool {
    blocks: usize,
    /// A stack: the lowest ids are taken first.
    free: Mutex<Vec<u32>>,
}

impl KvPool {
    pub fn new(blocks: usize) -> Result<Arc<Self>> {
        if blocks > i32::MAX as usize / KV_BLOCK {
            return Err(Error::InvalidArgument(format!("a KV pool of {blocks} blocks: the kernels take positions as 32-bit integers")));
        }
        Ok(Arc::new(KvPool { blocks, free: Mutex::new((0..blocks as u32).rev().collect()) }))
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn free_blocks(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        // The list stays consistent whatever panicked while it was held (pushes and truncations).
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The blocks one layer of one sequence holds, in position order; given back when dropped.
pub struct BlockList {
    pool: Arc<KvPool>,
    ids: Vec<u32>,
}

impl BlockList {
    pub fn new(pool: &Arc<KvPool>) -> Self {
        BlockList { pool: pool.clone(), ids: Vec::new() }
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Positions the blocks held can take.
    pub fn positions(&self) -> usize {
        self.ids.len() * KV_BLOCK
    }

    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Takes blocks until `positions` fit; returns how many were held before. All or nothing: a
    /// pool without enough free blocks is `Error::CacheFull`, and nothing is taken.
    pub fn grow(&mut self, positions: usize) -> Result<usize> {
        let before = self.ids.len();
        let more = blocks_for(positions).saturating_sub(before);
        if more > 0 {
            let mut free = self.pool.lock();
            if more > free.len() {
                return Err(Error::CacheFull(format!(
                    "{positions} positions need {more} more blocks of {KV_BLOCK}, and {} of the pool's {} are free",
                    free.len(),
                    self.pool.blocks
                )));
            }
            let from = free.len() - more;
            self.ids.extend(free.drain(from..).rev());
        }
        Ok(before)
    }
}

impl Drop for BlockList {
    fn drop(&mut self) {
        self.pool.lock().extend(self.ids.drain(..).rev());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_in_whole_and_given_back_on_drop() {
        let pool = KvPool::new(5).unwrap();
        let mut a = BlockList::new(&pool);
        assert_eq!(a.grow(1).unwrap(), 0);
        assert_eq!((a.ids(), a.positions()), (&[0u32][..], KV_BLOCK));
        assert_eq!(a.grow(KV_BLOCK).unwrap(), 1, "a full block takes no other");
        assert_eq!(a.grow(2 * KV_BLOCK + 1).unwrap(), 1);
        assert_eq!(a.ids(), [0, 1, 2]);
        let mut b = BlockList::new(&pool);
        let err = b.grow(3 * KV_BLOCK).unwrap_err();
        assert!(matches!(err, Error::CacheFull(_)), "{err}");
        assert!(err.to_string().contains("2 of the pool's 5 are free"), "{err}");
        assert_eq!((b.ids().len(), pool.free_blocks()), (0, 2), "a refused grow takes nothing");
        b.grow(2 * KV_BLOCK).unwrap();
        assert_eq!(b.ids(), [3, 4]);
        drop(a);
        assert_eq!(pool.free_blocks(), 3);
        let mut c = BlockList::new(&pool);
        c.grow(3 * KV_BLOCK).unwrap();
        assert_eq!(c.ids(), [0, 1, 2], "given-back blocks are taken again, lowest first");
    }

    #[test]
    fn a_pool_past_32_bit_positions_is_refused() {
        assert!(KvPool::new(i32::MAX as usize / KV_BLOCK + 1).is_err());
        assert_eq!(blocks_for(0), 0);
        assert_eq!(blocks_for(KV_BLOCK + 1), 2);
    }
}
