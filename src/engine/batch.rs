//! Continuous batching: one model serves several engines, one per sequence slot (see
//! `Engine::parallel`). Each engine runs its requests as it would alone, on its own thread; its
//! steps reach the model through a `SlotModel`. Single-token decode steps that are ready at the
//! same time run as one step of the model (`LanguageModel::step_batch`): the weights are read
//! once for all of them. The thread that finds no step running leads the next one: it waits (at
//! most `LINGER`) until every sequence still decoding has its token in, takes up to `MAX_ROWS`
//! of them, runs them, and hands each its result. A request joins or leaves between steps.
//!
//! Everything else (a prompt's prefill, drafted tokens, a request whose choice needs the token
//! mask or logit adjustments on the device, which are one per model) runs alone, the model
//! locked for that step only, so the other sequences go on between its steps.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::backend::{StepOutput, StepResult};
use crate::model::{BatchRow, LanguageModel, Meanwhile, ModelConfig, SavedCache};
use crate::sampling::Adjustment;
use crate::{Error, Result};

/// Rows of one batched step: the decode kernels give each token its single-step bits up to
/// this many (GEMV1_TOKENS in the GPU backend).
pub const MAX_ROWS: usize = 8;
/// How long the leader of a step waits for the other decoding sequences' tokens. Their host
/// work between steps (sampling, detokenizing) takes microseconds; a sequence that takes longer
/// catches the next step.
const LINGER: Duration = Duration::from_millis(2);

/// A mutex handed over in the order it was asked for. With std's mutex, which is not fair, a
/// sequence stepping in a loop takes the model again before a waiting thread wakes, and other
/// sequences' prefills starve until its whole answer is done.
struct FairMutex<T> {
    value: Mutex<T>,
    /// The next ticket to give out, and the ticket whose turn it is.
    turns: Mutex<(u64, u64)>,
    next: Condvar,
}

struct FairGuard<'a, T> {
    owner: &'a FairMutex<T>,
    guard: Option<MutexGuard<'a, T>>,
}

impl<T> FairMutex<T> {
    fn new(value: T) -> Self {
        FairMutex { value: Mutex::new(value), turns: Mutex::new((0, 0)), next: Condvar::new() }
    }

    /// Waits for this caller's turn. A panic in an earlier holder leaves the value usable.
    fn lock(&self) -> FairGuard<'_, T> {
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = turns.0;
        turns.0 += 1;
        while turns.1 != ticket {
            turns = self.next.wait(turns).unwrap_or_else(|p| p.into_inner());
        }
        drop(turns);
        FairGuard { owner: self, guard: Some(self.value.lock().unwrap_or_else(|p| p.into_inner())) }
    }
}

impl<T> std::ops::Deref for FairGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<T> std::ops::DerefMut for FairGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<T> Drop for FairGuard<'_, T> {
    fn drop(&mut self) {
        self.guard = None;
        self.owner.turns.lock().unwrap_or_else(|p| p.into_inner()).1 += 1;
        self.owner.next.notify_all();
    }
}

/// The model and the queue of decode steps that the slots share.
pub(super) struct Shared {
    model: FairMutex<Box<dyn LanguageModel>>,
    queue: Mutex<Queue>,
    changed: Condvar,
    /// The slot whose token mask and logit adjustments are on the device (None: neither is).
    device_state: Mutex<Option<usize>>,
    stats: Mutex<BatchStats>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<(u64, BatchRow)>,
    /// Slots that are decoding: a step's leader waits for their tokens.
    decoding: BTreeSet<usize>,
    leading: bool,
    done: HashMap<u64, Result<StepResult>>,
    next_ticket: u64,
}

/// How the decode steps were batched since the load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct BatchStats {
    /// Steps of the model that carried decode tokens.
    pub steps: u64,
    /// Tokens those steps carried.
    pub rows: u64,
    /// The most tokens one step carried.
    pub widest: usize,
    /// Steps a sequence ran by itself between the batched ones: pieces of prompts, checked
    /// drafts, requests with a token mask or logit biases.
    pub alone: u64,
}

impl Shared {
    pub(super) fn new(model: Box<dyn LanguageModel>) -> Arc<Self> {
        Arc::new(Shared {
            model: FairMutex::new(model),
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
            device_state: Mutex::new(None),
            stats: Mutex::new(BatchStats::default()),
        })
    }

    /// The model, in turn; a panic in an earlier step leaves it usable (each engine forgets its
    /// cache).
    fn model(&self) -> FairGuard<'_, Box<dyn LanguageModel>> {
        self.model.lock()
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn stats(&self) -> BatchStats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `row` and returns its result, leading a step when none is running.
    fn decode(&self, row: BatchRow) -> Result<StepResult> {
        let mut q = self.queue();
        let ticket = q.next_ticket;
        q.next_ticket += 1;
        q.waiting.push((ticket, row));
        q.decoding.insert(row.slot);
        self.changed.notify_all();
        loop {
            if let Some(result) = q.done.remove(&ticket) {
                return result;
            }
            if q.leading {
                q = self.changed.wait(q).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            q.leading = true;
            let deadline = Instant::now() + LINGER;
            while q.waiting.len() < q.decoding.len().min(MAX_ROWS) {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                q = self.changed.wait_timeout(q, left).unwrap_or_else(|p| p.into_inner()).0;
            }
            let take = q.waiting.len().min(MAX_ROWS);
            let batch: Vec<(u64, BatchRow)> = q.waiting.drain(..take).collect();
            drop(q);
            let results = self.run(&batch);
            q = self.queue();
            q.leading = false;
            for ((ticket, _), result) in batch.iter().zip(results) {
                q.done.insert(*ticket, result);
            }
            self.changed.notify_all();
        }
    }

    /// One step of the model for `batch`. A row whose sequence cannot take its KV blocks gets
    /// that error and stays out; every other row gets the step's error if it fails. A panic
    /// becomes that error too: unwinding past the queue would leave it led by no one.
    fn run(&self, batch: &[(u64, BatchRow)]) -> Vec<Result<StepResult>> {
        let mut refused: Vec<Option<Error>> = batch.iter().map(|_| None).collect();
        let step = std::panic::AssertUnwindSafe(|| {
            let mut model = self.model();
            clear_device_state(&mut model, &mut self.device_state.lock().unwrap_or_else(|p| p.into_inner()))?;
            for ((_, row), refusal) in batch.iter().zip(&mut refused) {
                *refusal = model.select(row.slot).and_then(|()| model.reserve(row.pos + 1)).err();
            }
            let rows: Vec<BatchRow> = batch.iter().zip(&refused).filter(|(_, r)| r.is_none()).map(|((_, row), _)| *row).collect();
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            model.step_batch(&rows)
        });
        let result = std::panic::catch_unwind(step).unwrap_or_else(|panic| {
            let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
            Err(Error::Device(format!("a batched decode step panicked: {}", what.unwrap_or_default())))
        });
        let ran = refused.iter().filter(|r| r.is_none()).count();
        let mut results: Box<dyn Iterator<Item = Result<StepResult>>> = match result {
            Ok(out) => {
                let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
                if ran > 0 {
                    stats.steps += 1;
                    stats.rows += ran as u64;
                    stats.widest = stats.widest.max(ran);
                }
                Box::new(out.into_iter().map(Ok))
            }
            Err(e) => {
                let message = e.to_string();
                let mut first = Some(e);
                Box::new(std::iter::repeat_with(move || Err(first.take().unwrap_or_else(|| Error::Device(message.clone())))))
            }
        };
        refused
            .into_iter()
            .map(|refusal| match refusal {
                Some(e) => Err(e),
                None => results.next().unwrap_or_else(|| Err(Error::Device("a batched step returned fewer rows than it ran".into()))),
            })
            .collect()
    }

    fn finish(&self, slot: usize) {
        let mut q = self.queue();
        q.decoding.remove(&slot);
        self.changed.notify_all();
    }
}

/// Turns the token mask and logit adjustments off where a slot left them on.
fn clear_device_state(model: &mut Box<dyn LanguageModel>, owner: &mut Option<usize>) -> Result<()> {
    if owner.take().is_some() {
        model.set_token_mask(None)?;
        model.set_logit_adjustments(&[])?;
    }
    Ok(())
}

/// One slot of a shared model, as its engine sees it: a model of its own.
pub(super) struct SlotModel {
    shared: Arc<Shared>,
    slot: usize,
    config: ModelConfig,
    description: String,
    can_rewind: bool,
    recurrent: bool,
    steps_round_alike: bool,
    can_draft: bool,
    /// What the backend can do on the device (asked once).
    masks_on_device: bool,
    adjusts_on_device: bool,
    /// This slot's token mask and logit adjustments, sent before each of its steps that
    /// finds the device holding another's.
    mask: Option<Vec<u32>>,
    adjustments: Vec<Adjustment>,
    /// They changed since they were last sent.
    dirty: bool,
}

impl SlotModel {
    pub(super) fn new(shared: &Arc<Shared>, slot: usize) -> Result<Self> {
        let mut model = shared.model();
        let mut owner = shared.device_state.lock().unwrap_or_else(|p| p.into_inner());
        *owner = None;
        let masks_on_device = model.set_token_mask(None)?;
        let adjusts_on_device = model.set_logit_adjustments(&[])?;
        Ok(SlotModel {
            shared: shared.clone(),
            slot,
            config: model.config().clone(),
            description: model.backend_description(),
            can_rewind: model.can_rewind(),
            recurrent: model.is_recurrent(),
            steps_round_alike: model.steps_round_alike(),
            can_draft: model.can_draft(),
            masks_on_device,
            adjusts_on_device,
            mask: None,
            adjustments: Vec::new(),
            dirty: false,
        })
    }

    /// The model with this slot selected and its device state in place.
    fn model(&mut self) -> Result<FairGuard<'_, Box<dyn LanguageModel>>> {
        let mut model = self.shared.model();
        model.select(self.slot)?;
        let mut owner = self.shared.device_state.lock().unwrap_or_else(|p| p.into_inner());
        if self.mask.is_none() && self.adjustments.is_empty() {
            clear_device_state(&mut model, &mut owner)?;
        } else if *owner != Some(self.slot) || self.dirty {
            if self.masks_on_device {
                model.set_token_mask(self.mask.as_deref())?;
            }
            if self.adjusts_on_device {
                model.set_logit_adjustments(&self.adjustments)?;
            }
            *owner = Some(self.slot);
        }
        self.dirty = false;
        Ok(model)
    }

    fn alone(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput, meanwhile: &mut Meanwhile<'_>) -> Result<StepResult> {
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).alone += 1;
        let mut mask = None;
        let result = {
            let mut model = self.model()?;
            model.step_with(tokens, start_pos, want, &mut || {
                let m = meanwhile()?;
                mask.clone_from(&m);
                Ok(m)
            })
        };
        // A mask set during the step is on the device now, as this slot's.
        if let Some(m) = mask {
            self.mask = Some(m);
        }
        result
    }
}

impl LanguageModel for SlotModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn step_with(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput, meanwhile: &mut Meanwhile<'_>) -> Result<StepResult> {
        let one_choice = matches!(want, StepOutput::Logits | StepOutput::Argmax { .. } | StepOutput::Draw { .. } | StepOutput::TopK { .. });
        let [token] = tokens else { return self.alone(tokens, start_pos, want, meanwhile) };
        if !one_choice || self.mask.is_some() || !self.adjustments.is_empty() {
            return self.alone(tokens, start_pos, want, meanwhile);
        }
        // A grammar's first mask: this step, and the request's later ones, run alone.
        if let Some(mask) = meanwhile()? {
            self.mask = Some(mask);
            self.dirty = true;
            return self.alone(tokens, start_pos, want, &mut || Ok(None));
        }
        self.shared.decode(BatchRow { slot: self.slot, token: *token, pos: start_pos, want })
    }

    fn set_token_mask(&mut self, mask: Option<&[u32]>) -> Result<bool> {
        self.mask = mask.map(<[u32]>::to_vec);
        self.dirty = true;
        Ok(self.masks_on_device)
    }

    fn set_logit_adjustments(&mut self, list: &[Adjustment]) -> Result<bool> {
        self.adjustments = list.to_vec();
        self.dirty = true;
        Ok(self.adjusts_on_device)
    }

    fn backend_description(&self) -> String {
        self.description.clone()
    }

    fn can_rewind(&self) -> bool {
        self.can_rewind
    }

    fn is_recurrent(&self) -> bool {
        self.recurrent
    }

    fn steps_round_alike(&self) -> bool {
        self.steps_round_alike
    }

    fn save(&mut self, start: usize, end: usize, with_state: bool) -> Result<SavedCache> {
        self.model()?.save(start, end, with_state)
    }

    fn restore(&mut self, pieces: &[&SavedCache]) -> Result<()> {
        self.model()?.restore(pieces)
    }

    fn keep_until(&mut self, end: usize) -> Result<()> {
        self.model()?.keep_until(end)
    }

    fn free_memory(&self) -> Option<usize> {
        self.shared.model().free_memory()
    }

    fn kv_usage(&self) -> Option<crate::model::KvUsage> {
        self.shared.model().kv_usage()
    }

    fn finish(&mut self) {
        self.shared.finish(self.slot);
        let mut model = self.shared.model();
        if model.select(self.slot).is_ok() {
            model.finish();
        }
    }

    fn claim(&mut self) -> bool {
        let mut model = self.shared.model();
        model.select(self.slot).is_ok() && model.claim()
    }

    fn can_draft(&self) -> bool {
        self.can_draft
    }

    fn set_drafting(&mut self, on: bool) {
        let mut model = self.shared.model();
        if model.select(self.slot).is_ok() {
            model.set_drafting(on);
        }
    }

    fn draft(&mut self, next: u32, pos: usize, k: usize, limit: usize, p_min: f32) -> Result<Vec<u32>> {
        self.model()?.draft(next, pos, k, limit, p_min)
    }
}

#[cfg(test)]
mod tests {
    use super::MAX_ROWS;
    use crate::backend::{StepOutput, StepResult};
    use crate::engine::{Device, Engine, EngineOptions, GenerateRequest, Generation};
    use crate::model::BatchRow;
    use crate::sampling::SamplingParams;
    use crate::Error;

    const FIXTURES: [&str; 4] = ["qwen3_untied_gqa", "qwen3_moe_tiny", "qwen3_5_tiny", "qwen3_5_moe_tiny"];

    fn load(name: &str, parallel: usize) -> Engine {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name);
        let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(256), parallel, ..EngineOptions::new(dir) };
        Engine::load(&opts, &mut |_| {}).unwrap()
    }

    fn prompt(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| (i * 7 + seed * 13 + 1) % 90 + 3).collect()
    }

    fn logits(r: StepResult) -> Vec<f32> {
        match r {
            StepResult::Logits(l) => l,
            other => panic!("not logits: {other:?}"),
        }
    }

    /// A step of three sequences of different lengths (dense, MoE and hybrid fixtures) gives
    /// each the logits, bit for bit, that it gets stepping alone on a model of one slot, three
    /// steps running (the recurrent states carried on), whatever the slots held before.
    #[test]
    fn a_batched_step_gives_each_sequence_the_logits_of_its_own_step() {
        for name in FIXTURES {
            let mut batched = load(name, 3);
            let mut alone = load(name, 1);
            let lens = [5, 17, 9];
            let model = batched.model.as_mut();
            for (slot, &len) in lens.iter().enumerate() {
                model.select(slot).unwrap();
                model.step(&prompt(slot as u32 + 9, 30), 0, StepOutput::Argmax { limit: usize::MAX }).unwrap();
                model.step(&prompt(slot as u32, len), 0, StepOutput::Argmax { limit: usize::MAX }).unwrap();
            }
            let mut expected = Vec::new();
            for (slot, &len) in lens.iter().enumerate() {
                let m = alone.model.as_mut();
                m.step(&prompt(slot as u32, len), 0, StepOutput::Argmax { limit: usize::MAX }).unwrap();
                let steps: Vec<Vec<f32>> = (0..3).map(|i| logits(m.step(&[40 + slot as u32 + i], len + i as usize, StepOutput::Logits).unwrap())).collect();
                expected.push(steps);
            }
            for i in 0..3 {
                let rows: Vec<BatchRow> = lens
                    .iter()
                    .enumerate()
                    .map(|(slot, &len)| BatchRow { slot, token: 40 + slot as u32 + i as u32, pos: len + i, want: StepOutput::Logits })
                    .collect();
                let out = model.step_batch(&rows).unwrap();
                for (slot, (r, want)) in out.into_iter().zip(expected.iter().map(|e| &e[i])).enumerate() {
                    assert_eq!(&logits(r), want, "{name}: slot {slot}, step {i}");
                }
            }
        }
    }

    /// More slots than a model takes is a clear error at load.
    #[test]
    fn too_many_slots_is_an_error_at_load() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3_moe_tiny");
        let opts = EngineOptions { device: Device::Cpu, parallel: 100_000, ..EngineOptions::new(dir) };
        let err = Engine::load(&opts, &mut |_| {}).err().expect("refused");
        assert!(err.to_string().contains("parallel 100000: at most 64"), "{err}");
    }

    /// Two sequences of a model whose KV pool holds 256 positions of every layer (one whole
    /// context, four blocks a layer): a sequence that would need more than the others leave is
    /// refused with `CacheFull`, taking nothing and harming no one; a finished sequence's blocks go
    /// to the next that needs them, and its own next request, which then finds its cache gone,
    /// starts again (from the prefix cache where it holds the history) with the same answer.
    /// Dense and hybrid fixtures.
    #[test]
    fn sequences_share_one_kv_pool_and_a_full_pool_refuses_cleanly() {
        for name in ["qwen3_untied_gqa", "qwen3_5_tiny"] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name);
            let probe = load(name, 1);
            let usage = probe.model.kv_usage().expect("a pool");
            let layers = probe.config().attention_layers();
            let one_context = crate::backend::kv_pool::blocks_for(256) * layers * usage.block_bytes;
            let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(256), parallel: 2, kv_cache_bytes: Some(one_context), ..EngineOptions::new(dir) };
            let mut engines = Engine::load(&opts, &mut |_| {}).unwrap().split().unwrap();
            let greedy = |prompt: Vec<u32>, n| GenerateRequest { prompt, max_tokens: Some(n), sampling: SamplingParams::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None };
            let mut alone = load(name, 1);

            // Slot 0 reads 150 positions (three blocks a layer) and stays in the middle of its
            // request (no `finish`); slot 1 then asks for 200: refused, nothing taken.
            let first = prompt(1, 150);
            let model = engines[0].model.as_mut();
            model.step(&first, 0, StepOutput::Logits).unwrap();
            let used = model.kv_usage().unwrap().used_blocks;
            assert_eq!(used, 3 * layers, "{name}");
            let err = engines[1].model.step(&prompt(2, 200), 0, StepOutput::Logits).unwrap_err();
            assert!(matches!(err, Error::CacheFull(_)), "{name}: {err}");
            assert!(err.to_string().contains("kv_cache_bytes"), "{name}: {err}");
            assert_eq!(engines[1].model.kv_usage().unwrap().used_blocks, used, "{name}: a refused step took blocks");
            // Slot 0 goes on as if nothing happened.
            let next = engines[0].model.step(&[7], 150, StepOutput::Logits).unwrap();
            alone.model.step(&first, 0, StepOutput::Logits).unwrap();
            assert_eq!(logits(next), logits(alone.model.step(&[7], 150, StepOutput::Logits).unwrap()), "{name}");
            engines[0].reset_cache();

            // Whole requests: slot 0's answer, then slot 1's 200 positions (slot 0's blocks go to
            // it), then slot 0's follow-up, which finds its cache gone.
            let turn = greedy(prompt(3, 150), 10);
            let answer = engines[0].generate_raw(&turn).unwrap();
            assert_eq!(answer.tokens, alone.generate_raw(&turn).unwrap().tokens, "{name}");
            let other = greedy(prompt(4, 200), 8);
            assert_eq!(engines[1].generate_raw(&other).unwrap().tokens, alone.generate_raw(&other).unwrap().tokens, "{name}");
            let mut follow = turn.prompt.clone();
            follow.extend(&answer.tokens);
            follow.extend(prompt(5, 20));
            let follow = greedy(follow, 10);
            let got = engines[0].generate_raw(&follow).unwrap();
            let mut fresh = load(name, 1);
            assert_eq!(got.tokens, fresh.generate_raw(&follow).unwrap().tokens, "{name}: the follow-up after its blocks went elsewhere");
            // A hybrid model saves its state at the end of every turn; a dense one keeps whole
            // blocks of 256 positions only (this history is shorter: recomputed).
            if probe.model.is_recurrent() {
                assert!(got.cached_tokens > 0, "{name}: the follow-up did not start from the prefix cache");
            }
        }
    }

    fn request(agent: usize, turn: usize) -> GenerateRequest {
        // Greedy, seeded temperature, top-k/top-p, and biased requests mixed.
        let sampling = match (agent + turn) % 4 {
            0 => SamplingParams::default(),
            1 => SamplingParams { temperature: 0.9, seed: Some(agent as u64 * 31 + turn as u64), ..Default::default() },
            2 => SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.9, seed: Some(7 + agent as u64), ..Default::default() },
            _ => SamplingParams { temperature: 0.8, logit_bias: vec![(5, 3.0)], presence_penalty: 0.5, seed: Some(turn as u64), ..Default::default() },
        };
        let prompt = prompt(agent as u32 * 5 + turn as u32, 6 + 5 * agent + turn);
        GenerateRequest { prompt, max_tokens: Some(24), sampling, stop: vec![], ignore_eos: true, grammar: None, logprobs: None }
    }

    fn run(engine: &mut Engine, agent: usize) -> Vec<Generation> {
        (0..3).map(|turn| engine.generate(&request(agent, turn), &mut |_| true).unwrap()).collect()
    }

    /// On a shared model a long prompt is read in pieces of `prefill_chunk` positions, each a
    /// step of its own (taking the model in turn, so that the others' decode steps run between
    /// them), and the answer is the one a model of its own gives, reading it in one step.
    #[test]
    fn a_long_prompt_is_read_in_pieces_and_answers_as_in_one_step() {
        for name in FIXTURES {
            let request = GenerateRequest { prompt: prompt(3, 150), max_tokens: Some(8), ..request(0, 0) };
            let expected = load(name, 1).generate(&request, &mut |_| true).unwrap().tokens;
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name);
            let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(256), parallel: 2, prefill_chunk: 32, ..EngineOptions::new(dir) };
            let mut engines = Engine::load(&opts, &mut |_| {}).unwrap().split().unwrap();
            let got = engines[0].generate(&request, &mut |_| true).unwrap().tokens;
            assert_eq!(got, expected, "{name}");
            // 150 positions: pieces at 0, 32, 64, 96 and 128, the last with the logits (recurrent
            // models also end pieces where they keep states).
            assert!(engines[0].batch_stats().alone >= 5, "{name}: {:?}", engines[0].batch_stats());
        }
    }

    /// Engines of one model on as many threads: every request (greedy, sampled, biased: some run
    /// batched, some alone) answers as it does on a model of its own, and decode steps did carry
    /// several sequences.
    #[test]
    fn engines_on_several_threads_decode_together_and_answer_as_alone() {
        for name in ["qwen3_moe_tiny", "qwen3_5_tiny"] {
            let agents = 4;
            let mut single = load(name, 1);
            let expected: Vec<Vec<Vec<u32>>> =
                (0..agents).map(|a| run(&mut single, a).into_iter().map(|g| g.tokens).collect()).collect();
            let engines = load(name, agents).split().unwrap();
            assert_eq!(engines.len(), agents);
            let stats = engines[0].batch.clone().unwrap();
            std::thread::scope(|s| {
                for (agent, mut engine) in engines.into_iter().enumerate() {
                    let expected = &expected[agent];
                    s.spawn(move || {
                        let got: Vec<Vec<u32>> = run(&mut engine, agent).into_iter().map(|g| g.tokens).collect();
                        assert_eq!(&got, expected, "{name}: agent {agent}");
                    });
                }
            });
            let stats = stats.stats();
            assert!(stats.widest >= 2 && stats.widest <= MAX_ROWS, "{name}: {stats:?}");
            assert!(stats.rows > stats.steps, "{name}: {stats:?}");
        }
    }
}
