//! Model handles of the C ABI and the rules of calling into one model:
//! - a handle is a key into a table, never a pointer the library dereferences: after
//!   `atlas_unload` it is simply not found;
//! - every call that found the handle counts as inside the model until it returns, and unload
//!   waits for that count to reach zero before it frees the engine;
//! - the model has one engine per sequence slot (load option `parallel`): up to that many
//!   requests run at once, their decode steps batched; requests take a ticket on arrival and get
//!   an engine strictly in that order (a mutex alone is not fair), preparing their prompts while
//!   they wait;
//! - a thread that is inside a request's `on_chunk` callback and calls back into the same model
//!   is detected instead of deadlocking on the engine it already holds.

use std::cell::{Cell, RefCell};
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
    /// Engines no request holds (one per sequence slot of the model).
    free: Vec<Engine>,
    unloaded: bool,
}

impl Loaded {
    /// `engines`: one per sequence slot of one model (`Engine::split`), at least one.
    pub fn new(engines: Vec<Engine>, info: String, max_request_bytes: usize) -> Result<Self> {
        let front = engines.first().ok_or_else(|| Error::InvalidArgument("a model without an engine".into()))?.frontend().clone();
        Ok(Loaded {
            front,
            info,
            max_request_bytes,
            calls: Mutex::new(Calls { free: engines, ..Calls::default() }),
            changed: Condvar::new(),
        })
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
        Turn { loaded: self, ticket, admitted: Cell::new(false) }
    }
}

pub struct Turn<'a> {
    loaded: &'a Loaded,
    ticket: u64,
    /// It got its engine (and passed the turn on).
    admitted: Cell<bool>,
}

impl Calls {
    /// The ticket after `ticket` that has not been given up.
    fn pass_on(&mut self, ticket: u64) {
        let mut next = ticket + 1;
        while self.abandoned.remove(&next) {
            next += 1;
        }
        self.serving = next;
    }
}

impl<'a> Turn<'a> {
    /// Waits for this turn and a free engine, takes it, and lets the next ticket wait for one.
    pub fn engine(&self) -> Result<EngineGuard<'a>> {
        let loaded = self.loaded;
        let mut calls = loaded.calls();
        while !calls.unloaded && (calls.serving != self.ticket || calls.free.is_empty()) {
            calls = loaded.changed.wait(calls).unwrap_or_else(|p| p.into_inner());
        }
        if calls.unloaded {
            return Err(Error::InvalidArgument("the model was unloaded".into()));
        }
        let engine = calls.free.pop().ok_or_else(|| Error::InvalidArgument("the model was unloaded".into()))?;
        calls.pass_on(self.ticket);
        self.admitted.set(true);
        drop(calls);
        loaded.changed.notify_all();
        Ok(EngineGuard { loaded, engine: Some(engine) })
    }
}

impl Drop for Turn<'_> {
    /// Gives up a turn that got no engine (its request failed early).
    fn drop(&mut self) {
        if self.admitted.get() {
            return;
        }
        let mut calls = self.loaded.calls();
        if calls.serving == self.ticket {
            calls.pass_on(self.ticket);
        } else {
            calls.abandoned.insert(self.ticket);
        }
        drop(calls);
        self.loaded.changed.notify_all();
    }
}

/// An engine, held by one request; it goes back to the model's free engines when dropped.
pub struct EngineGuard<'a> {
    loaded: &'a Loaded,
    engine: Option<Engine>,
}

impl EngineGuard<'_> {
    pub fn get(&mut self) -> &mut Engine {
        self.engine.as_mut().expect("held until the guard is dropped")
    }
}

impl Drop for EngineGuard<'_> {
    fn drop(&mut self) {
        let Some(mut engine) = self.engine.take() else { return };
        // A panic in the request may have left the cache half-written: forget it.
        if std::thread::panicking() {
            engine.reset_cache();
        }
        self.loaded.calls().free.push(engine);
        self.loaded.changed.notify_all();
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
    calls.unloaded = true;
    let engines = std::mem::take(&mut calls.free);
    drop(calls);
    drop(engines);
}
