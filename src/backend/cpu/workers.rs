//! The CPU backend's threads. A decode step is hundreds of small parallel loops (a 576-wide
//! projection takes tens of microseconds), so handing each loop through the OS scheduler, as a
//! general pool does when its caller waits on a condition variable, costs as much as the work.
//! Here the caller runs the first share of every loop itself, and the helpers spin for a while
//! after each loop, as the next one usually comes within microseconds; only then do they sleep.
//! Each loop's items are cut into one contiguous run per thread, so every item is computed by the
//! same code whatever the thread count, and a thread streams through neighbouring weight rows.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How long an idle helper spins before it sleeps: longer than the gaps between a step's loops
/// (norms, the sampler), far shorter than the gap between requests.
const SPIN: Duration = Duration::from_micros(200);

pub struct Workers {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
}

/// One loop, as the helpers see it: `call(share)` for each share after the caller's.
#[derive(Clone, Copy)]
struct Job {
    call: *const (dyn Fn(usize) + Sync),
    shares: usize,
}

// SAFETY: `call` points to a `Sync` closure that `Workers::run` keeps alive until every helper
// has returned from it.
unsafe impl Send for Job {}

struct Shared {
    /// Bumped once per loop; a helper works when it sees a value it has not seen.
    generation: AtomicU64,
    /// The current loop and its generation, read together so no helper runs a loop twice.
    job: Mutex<Option<(u64, Job)>>,
    /// Helpers still running their share of the current loop.
    pending: AtomicUsize,
    /// Whether a helper's share panicked in the current loop.
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    asleep: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

/// One thread per physical core, at most one per CPU this process may use: a core's second
/// hardware thread shares the vector units that these loops keep busy, so it adds contention,
/// not speed (llama.cpp's default too). The cores are counted from Linux's CPU topology; elsewhere,
/// or if it cannot be read, every CPU the OS offers.
fn default_threads() -> usize {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    physical_cores().map_or(available, |cores| cores.clamp(1, available))
}

/// Distinct (package, core) pairs among the online CPUs.
fn physical_cores() -> Option<usize> {
    let read = |path: std::path::PathBuf| std::fs::read_to_string(path).ok().map(|s| s.trim().to_string());
    let mut cores = std::collections::HashSet::new();
    for entry in std::fs::read_dir("/sys/devices/system/cpu").ok()?.flatten() {
        let name = entry.file_name();
        let is_cpu = name.to_str().is_some_and(|n| n.strip_prefix("cpu").is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit())));
        // An offline CPU says "0" in `online` (cpu0 often has no such file: always online).
        if !is_cpu || read(entry.path().join("online")).is_some_and(|o| o == "0") {
            continue;
        }
        let topology = entry.path().join("topology");
        cores.insert((read(topology.join("physical_package_id"))?, read(topology.join("core_id"))?));
    }
    (!cores.is_empty()).then_some(cores.len())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Workers {
    /// `threads` threads in all (the caller and `threads - 1` helpers); 0 = one per physical core
    /// (`default_threads`).
    pub fn new(threads: usize) -> Result<Self> {
        let threads = if threads == 0 { default_threads() } else { threads };
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: Mutex::new(None),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            asleep: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let mut workers = Workers { shared, helpers: Vec::new() };
        for share in 1..threads {
            let shared = Arc::clone(&workers.shared);
            let helper = std::thread::Builder::new()
                .name(format!("atlas-cpu-{share}"))
                .spawn(move || help(&shared, share))
                .map_err(|e| Error::Device(format!("cannot start CPU threads: {e}")))?;
            workers.helpers.push(helper);
        }
        Ok(workers)
    }

    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Calls `work(&mut state, index, item)` for every item, each thread taking one contiguous
    /// run of them with a `state` from `init` (scratch space reused across its items).
    pub fn for_each<I: Send, S>(&self, items: &mut [I], init: impl Fn() -> S + Sync, work: impl Fn(&mut S, usize, &mut I) + Sync) {
        let shares = self.threads().min(items.len());
        if shares <= 1 {
            let mut state = init();
            items.iter_mut().enumerate().for_each(|(i, item)| work(&mut state, i, item));
            return;
        }
        let mut runs = Vec::with_capacity(shares);
        let (mut rest, mut first) = (items, 0);
        for share in 0..shares {
            let len = rest.len() / (shares - share);
            let (run, tail) = rest.split_at_mut(len);
            runs.push(Mutex::new((first, run)));
            (rest, first) = (tail, first + len);
        }
        self.run(shares, &|share| {
            let mut run = lock(&runs[share]);
            let (first, ref mut items) = *run;
            let mut state = init();
            for (i, item) in items.iter_mut().enumerate() {
                work(&mut state, first + i, item);
            }
        });
    }

    /// `call(share)` for every share in 0..shares (at most `threads`), the caller taking share 0;
    /// returns when all are done, re-raising a helper's panic.
    fn run(&self, shares: usize, call: &(dyn Fn(usize) + Sync)) {
        let shared = &*self.shared;
        // SAFETY: only the lifetime changes; `Wait` below keeps `call` borrowed until every
        // helper that took this job has finished with it, even when share 0 panics.
        let call: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(call as *const (dyn Fn(usize) + Sync + '_)) };
        shared.panicked.store(false, SeqCst);
        shared.pending.store(shares - 1, SeqCst);
        {
            let mut job = lock(&shared.job);
            *job = Some((shared.generation.load(SeqCst) + 1, Job { call, shares }));
            shared.generation.fetch_add(1, SeqCst);
        }
        if shared.sleepers.load(SeqCst) > 0 {
            let _asleep = lock(&shared.asleep);
            shared.wake.notify_all();
        }
        let wait = Wait(shared);
        // SAFETY: `call` is alive here (it is this function's argument).
        unsafe { (*call)(0) };
        drop(wait);
        if shared.panicked.load(SeqCst) {
            resume_unwind(Box::new("a CPU worker thread panicked"));
        }
    }
}

/// Waits for the helpers' shares when dropped (also while share 0 unwinds).
struct Wait<'a>(&'a Shared);

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        let started = Instant::now();
        let mut spins = 0u32;
        while self.0.pending.load(SeqCst) > 0 {
            spins = spins.wrapping_add(1);
            if started.elapsed() < SPIN && !spins.is_multiple_of(64) {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A helper's life: wait for a loop, run its share, repeat.
fn help(shared: &Shared, share: usize) {
    let mut seen = 0;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        while shared.generation.load(SeqCst) == seen && !shared.stop.load(SeqCst) {
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            if started.elapsed() < SPIN {
                // Another thread of the process that is ready to run (a request finishing on
                // the host's side) gets the core now, not when the spin ends.
                std::thread::yield_now();
                continue;
            }
            let mut asleep = lock(&shared.asleep);
            shared.sleepers.fetch_add(1, SeqCst);
            while shared.generation.load(SeqCst) == seen && !shared.stop.load(SeqCst) {
                asleep = shared.wake.wait(asleep).unwrap_or_else(|p| p.into_inner());
            }
            shared.sleepers.fetch_sub(1, SeqCst);
        }
        if shared.stop.load(SeqCst) {
            return;
        }
        let Some((generation, job)) = *lock(&shared.job) else { continue };
        seen = generation;
        if share < job.shares {
            // SAFETY: the caller of `run` waits for `pending` to reach zero before `call` dies.
            let call = unsafe { &*job.call };
            if catch_unwind(AssertUnwindSafe(|| call(share))).is_err() {
                shared.panicked.store(true, SeqCst);
            }
            shared.pending.fetch_sub(1, SeqCst);
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        {
            let _asleep = lock(&self.shared.asleep);
            self.shared.wake.notify_all();
        }
        for helper in self.helpers.drain(..) {
            let _ = helper.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_is_visited_once_with_its_index() {
        for threads in [1, 2, 3, 5] {
            let workers = Workers::new(threads).unwrap();
            for n in [0, 1, 2, 7, 100] {
                let mut items = vec![usize::MAX; n];
                workers.for_each(&mut items, || (), |_, i, item| *item = i);
                assert_eq!(items, (0..n).collect::<Vec<_>>(), "{threads} threads, {n} items");
            }
        }
    }

    #[test]
    fn helpers_wake_after_sleeping() {
        let workers = Workers::new(2).unwrap();
        let mut items = vec![0u32; 8];
        for round in 1..=3 {
            std::thread::sleep(SPIN * 5);
            workers.for_each(&mut items, || (), |_, _, item| *item += 1);
            assert!(items.iter().all(|&v| v == round));
        }
    }

    #[test]
    fn a_panicking_item_reaches_the_caller_and_the_workers_stay_usable() {
        let workers = Workers::new(2).unwrap();
        for poisoned in [0, 7] {
            let mut items = vec![0u32; 8];
            let result = catch_unwind(AssertUnwindSafe(|| {
                workers.for_each(&mut items, || (), |_, i, _| assert_ne!(i, poisoned, "poisoned item"));
            }));
            assert!(result.is_err(), "item {poisoned}");
        }
        let mut items = vec![0u32; 8];
        workers.for_each(&mut items, || (), |_, i, item| *item = i as u32 * 2);
        assert_eq!(items[7], 14);
    }
}
