//! Model handles of the C ABI and the rules of calling into one model:
//! - a handle is a key into a table, never a pointer the library dereferences: after
//!   `atlas_unload` it is simply not found;
//! - every call that found the handle counts as inside the model until it returns, and unload
//!   waits for that count to reach zero before it frees the engine;
//! - requests take a ticket on arrival and use the engine strictly in that order (a mutex alone
//!   is not fair), preparing their prompts while they wait;
//! - a thread that is inside a request's `on_chunk` callback and calls back into the same model
//!   is detected instead of deadlocking on the engine it already holds.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};

use super::AtlasModel;
use crate::engine::{Engine, Frontend};
use crate::{Error, Result};

/// Loaded models by handle. Handles are never reused, so a stale one cannot reach a newer model.
static MODELS: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry { next: 1, models: HashMap::new() }));

struct Registry {
    next: usize,
    models: HashMap<usize, Arc<Loaded>>,
}

fn registry() -> MutexGuard<'static, Registry> {
    MODELS.lock().unwrap_or_else(|p| p.into_inner())
}

/// One loaded model as the C ABI sees it.
pub struct Loaded {
    /// Tokenizer, template and limits: used without waiting for the engine.
    pub front: Frontend,
    /// The load report as JSON, answered without the engine (also from inside a callback).
    pub info: String,
    pub max_request_bytes: usize,
    /// None once unloaded.
    engine: Mutex<Option<Engine>>,
    calls: Mutex<Calls>,
    changed: Condvar,
}

#[derive(Default)]
struct Calls {
    /// Calls that found the handle and have not returned yet.
    inside: usize,
    next_ticket: u64,
    /// The ticket whose request may use the engine now.
    serving: u64,
    /// Tickets given up before their turn came (their requests failed early): skipped.
    abandoned: BTreeSet<u64>,
}

impl Loaded {
    pub fn new(engine: Engine, info: String, max_request_bytes: usize) -> Self {
        Loaded {
            front: engine.frontend().clone(),
            info,
            max_request_bytes,
            engine: Mutex::new(Some(engine)),
            calls: Mutex::new(Calls::default()),
            changed: Condvar::new(),
        }
    }

    fn calls(&self) -> MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place in this model's queue, taken on arrival: requests use the engine first come,
    /// first served (a mutex alone is not fair), and may prepare their prompts while they wait.
    pub fn take_turn(&self) -> Turn<'_> {
        let mut calls = self.calls();
        let ticket = calls.next_ticket;
        calls.next_ticket += 1;
        Turn { loaded: self, ticket }
    }
}

pub struct Turn<'a> {
    loaded: &'a Loaded,
    ticket: u64,
}

impl<'a> Turn<'a> {
    /// Waits for this turn, then takes the engine.
    pub fn engine(&self) -> Result<EngineGuard<'a>> {
        let loaded = self.loaded;
        let mut calls = loaded.calls();
        while calls.serving != self.ticket {
            calls = loaded.changed.wait(calls).unwrap_or_else(|p| p.into_inner());
        }
        drop(calls);
        let engine = loaded.engine.lock().unwrap_or_else(|poisoned| {
            // A panic in an earlier request may have left the cache half-written: forget it.
            loaded.engine.clear_poison();
            let mut engine = poisoned.into_inner();
            if let Some(e) = engine.as_mut() {
                e.reset_cache();
            }
            engine
        });
        if engine.is_none() {
            return Err(Error::InvalidArgument("the model was unloaded".into()));
        }
        Ok(EngineGuard { engine })
    }
}

impl Drop for Turn<'_> {
    /// Passes the turn on, or gives up a turn that has not come yet.
    fn drop(&mut self) {
        let mut calls = self.loaded.calls();
        if calls.serving == self.ticket {
            let mut next = self.ticket + 1;
            while calls.abandoned.remove(&next) {
                next += 1;
            }
            calls.serving = next;
        } else {
            calls.abandoned.insert(self.ticket);
        }
        drop(calls);
        self.loaded.changed.notify_all();
    }
}

/// The engine, held during a turn (drop it before the turn).
pub struct EngineGuard<'a> {
    engine: MutexGuard<'a, Option<Engine>>,
}

impl EngineGuard<'_> {
    pub fn get(&mut self) -> &mut Engine {
        self.engine.as_mut().expect("checked when the guard was made")
    }
}

/// Registers a loaded model and returns its handle.
pub fn insert(loaded: Loaded) -> *mut AtlasModel {
    let mut reg = registry();
    let id = reg.next;
    reg.next += 1;
    reg.models.insert(id, Arc::new(loaded));
    handle_of(id)
}

/// Handles are ids shifted to look like aligned pointers (never NULL, never dereferenced).
fn handle_of(id: usize) -> *mut AtlasModel {
    (id << 4) as *mut AtlasModel
}

/// The id behind a handle; None for a value no handle ever had.
fn id_of(handle: *mut AtlasModel) -> Option<usize> {
    let bits = handle as usize;
    (bits != 0 && bits & 0xf == 0).then_some(bits >> 4)
}

/// A call inside a model: the model cannot be freed until it is dropped.
pub struct Call {
    id: usize,
    pub loaded: Arc<Loaded>,
}

impl Call {
    pub fn enter(handle: *mut AtlasModel) -> Result<Call> {
        if handle.is_null() {
            return Err(Error::InvalidArgument("model is NULL".into()));
        }
        let reg = registry();
        let found = id_of(handle).and_then(|id| Some((id, reg.models.get(&id)?.clone())));
        let (id, loaded) = found.ok_or_else(|| {
            Error::InvalidArgument(format!("model handle {handle:p} is not loaded (unloaded, or not from atlas_load)"))
        })?;
        // Counted while the registry is locked: an unload that removes the handle after this
        // point sees the call and waits for it.
        loaded.calls().inside += 1;
        Ok(Call { id, loaded })
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let mut calls = self.loaded.calls();
        calls.inside -= 1;
        drop(calls);
        self.loaded.changed.notify_all();
    }
}

thread_local! {
    /// Models whose request this thread is running (their callbacks run on it).
    static RUNNING: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

fn running_here(id: usize) -> bool {
    RUNNING.with(|r| r.borrow().contains(&id))
}

/// Marks the calling thread as running a request on `call`'s model, refusing a second,
/// re-entrant one: it would wait forever for the engine its own thread holds.
pub struct Reentry {
    id: usize,
}

impl Reentry {
    pub fn begin(call: &Call) -> Result<Reentry> {
        if running_here(call.id) {
            return Err(Error::InvalidArgument(
                "atlas_chat_completion called from inside an on_chunk callback of a request on the same model \
                 (it would wait for itself): call it after the outer request returns"
                    .into(),
            ));
        }
        RUNNING.with(|r| r.borrow_mut().push(call.id));
        Ok(Reentry { id: call.id })
    }
}

impl Drop for Reentry {
    fn drop(&mut self) {
        RUNNING.with(|r| {
            let mut r = r.borrow_mut();
            if let Some(at) = r.iter().rposition(|&id| id == self.id) {
                r.remove(at);
            }
        });
    }
}

/// Removes the handle, so later calls fail cleanly, then waits for every call that entered and
/// frees the engine. From inside a callback of a request on the same model it cannot wait for
/// that request: the model is then freed when the request returns (the last reference goes).
pub fn unload(handle: *mut AtlasModel) {
    let Some(id) = id_of(handle) else { return };
    let Some(loaded) = registry().models.remove(&id) else { return };
    if running_here(id) {
        return;
    }
    let mut calls = loaded.calls();
    while calls.inside > 0 {
        calls = loaded.changed.wait(calls).unwrap_or_else(|p| p.into_inner());
    }
    drop(calls);
    let engine = loaded.engine.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(engine);
}
