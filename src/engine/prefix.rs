//! The prefix cache: pieces of earlier sequences' caches, kept so that a request whose prompt
//! begins as an earlier one did (the same system prompt and tools, the history of a conversation
//! that another one interrupted) starts from them instead of computing them again.
//!
//! Pieces form a tree of token blocks (a radix tree with fixed-size edges): each node holds the
//! cache of positions `start..start + tokens.len()`, saved with `LanguageModel::save`, and its
//! parent the `BLOCK` positions before. Full blocks continue the tree; shorter pieces end it (the
//! end of a prompt or of a turn). Tokens are compared, not hashed: a match is exact.
//!
//! Recurrent layers (Gated DeltaNet) keep one state for all positions before, which keys and
//! values cannot rebuild: a model with them resumes only where a piece carries that state. They
//! are saved at the end of each prompt and turn and every `STATE_EVERY` positions of a long
//! prompt, so that an edited history costs at most that many positions again (a Qwen3.5-27B
//! state is 150 MB: one per block would cost more than the keys and values).
//!
//! Memory: every piece counts its bytes against a budget; the least recently used pieces without
//! children go first. A piece that cannot fit is not saved (never an error).

use crate::model::{LanguageModel, SavedCache};
use crate::Result;

/// Positions per block: the unit of sharing.
pub const BLOCK: usize = 256;
/// Recurrent models: positions between saved states within one long prompt.
pub const STATE_EVERY: usize = 4 * BLOCK;

const ROOT: usize = 0;

struct Node {
    parent: usize,
    start: usize,
    tokens: Vec<u32>,
    /// None for the root, and for a slot freed by eviction.
    saved: Option<SavedCache>,
    children: Vec<usize>,
    last_used: u64,
}

impl Node {
    fn end(&self) -> usize {
        self.start + self.tokens.len()
    }
}

/// Where a prompt can start: the pieces to restore, in order, covering `0..depth`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub depth: usize,
    nodes: Vec<usize>,
}

pub struct PrefixCache {
    budget: usize,
    block: usize,
    state_every: usize,
    used: usize,
    /// Slot 0 is the root; freed slots are reused.
    nodes: Vec<Node>,
    free: Vec<usize>,
    clock: u64,
    /// Pieces evicted so far.
    evicted: usize,
}

impl PrefixCache {
    /// A cache of at most `budget` bytes (0: none is kept).
    pub fn new(budget: usize) -> Self {
        Self::with_geometry(budget, BLOCK, STATE_EVERY)
    }

    /// Blocks of `block` positions, recurrent states every `state_every` (tests use small ones).
    pub fn with_geometry(budget: usize, block: usize, state_every: usize) -> Self {
        let root = Node { parent: ROOT, start: 0, tokens: Vec::new(), saved: None, children: Vec::new(), last_used: 0 };
        let block = block.max(1);
        let state_every = state_every.max(block);
        PrefixCache { budget, block, state_every, used: 0, nodes: vec![root], free: Vec::new(), clock: 0, evicted: 0 }
    }

    /// Positions between the states a recurrent model saves within one prompt.
    pub fn state_every(&self) -> usize {
        self.state_every
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Bytes the saved pieces hold.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Saved pieces.
    pub fn len(&self) -> usize {
        self.nodes.len() - 1 - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pieces evicted to make room, since the start.
    pub fn evicted(&self) -> usize {
        self.evicted
    }

    /// Forgets every piece.
    pub fn clear(&mut self) {
        *self = PrefixCache::with_geometry(self.budget, self.block, self.state_every);
    }

    /// The child of `parent` that holds exactly `tokens` from its start.
    fn child(&self, parent: usize, tokens: &[u32]) -> Option<usize> {
        self.nodes[parent].children.iter().copied().find(|&c| self.nodes[c].tokens == tokens)
    }

    /// The deepest restorable start for `prompt`, at most `limit` positions; with `need_state`
    /// (a model with recurrent layers) only where a piece carries the state. Marks what it finds
    /// as used.
    pub fn lookup(&mut self, prompt: &[u32], limit: usize, need_state: bool) -> Option<Hit> {
        let mut path = Vec::new();
        let mut best: Option<Hit> = None;
        let mut node = ROOT;
        let mut depth = 0;
        loop {
            // Pieces that end here (shorter than a block, or a full one) and fit the prompt.
            for &c in &self.nodes[node].children {
                let n = &self.nodes[c];
                let end = n.end();
                let usable = end <= limit && prompt.get(depth..end) == Some(n.tokens.as_slice());
                let state_ok = !need_state || n.saved.as_ref().is_some_and(|s| s.has_state);
                if usable && state_ok && best.as_ref().is_none_or(|b| end > b.depth) {
                    let mut nodes = path.clone();
                    nodes.push(c);
                    best = Some(Hit { depth: end, nodes });
                }
            }
            let next = prompt.get(depth..depth + self.block).and_then(|block| self.child(node, block));
            match next {
                Some(c) => {
                    path.push(c);
                    node = c;
                    depth += self.block;
                }
                None => break,
            }
        }
        let hit = best?;
        self.touch(*hit.nodes.last()?);
        Some(hit)
    }

    /// The saved pieces of `hit` that end past `from` (the positions before are the model's own).
    pub fn pieces(&self, hit: &Hit, from: usize) -> Vec<&SavedCache> {
        hit.nodes.iter().filter_map(|&n| self.nodes[n].saved.as_ref()).filter(|s| s.end > from).collect()
    }

    /// Marks `node` and its ancestors as just used.
    fn touch(&mut self, mut node: usize) {
        self.clock += 1;
        while node != ROOT {
            self.nodes[node].last_used = self.clock;
            node = self.nodes[node].parent;
        }
    }

    /// Saves what the model's cache holds of `tokens` (positions `0..tokens.len()`, the last step
    /// having ended at its end) and the cache does not: every full block, and the tail, with the
    /// recurrent state where the model has one. Stops quietly when memory runs out.
    pub fn save(&mut self, model: &mut dyn LanguageModel, tokens: &[u32]) -> Result<()> {
        let recurrent = model.is_recurrent();
        let end = tokens.len();
        let mut node = ROOT;
        let mut start = 0;
        while start < end {
            let piece_end = (start + self.block).min(end);
            let piece = &tokens[start..piece_end];
            // A recurrent model's state is at `end` only.
            let with_state = recurrent && piece_end == end;
            // Keys and values alone of a short tail are not worth a piece: the next request
            // recomputes less than a block.
            if piece.len() < self.block && !with_state {
                break;
            }
            let existing = self.child(node, piece);
            let child = match existing {
                Some(c) if !with_state || self.nodes[c].saved.as_ref().is_some_and(|s| s.has_state) => c,
                _ => {
                    let Some(c) = self.insert(model, node, start, piece, with_state)? else { break };
                    c
                }
            };
            self.touch(child);
            if piece.len() < self.block {
                break;
            }
            node = child;
            start = piece_end;
        }
        Ok(())
    }

    /// Saves positions `start..start + piece.len()` as a child of `parent` (replacing a child of
    /// the same tokens saved without a state); None when the budget cannot make room.
    fn insert(&mut self, model: &mut dyn LanguageModel, parent: usize, start: usize, piece: &[u32], with_state: bool) -> Result<Option<usize>> {
        // The saved copy's size is known once it is made; the live cache, not this copy, is what
        // the next step needs, so a copy that does not fit is simply dropped.
        let saved = model.save(start, start + piece.len(), with_state)?;
        if saved.bytes > self.budget {
            return Ok(None);
        }
        self.touch(parent);
        let protect = self.ancestors(parent);
        let replaced = self.child(parent, piece);
        while self.used + saved.bytes > self.budget {
            match self.least_recently_used(&protect, replaced) {
                Some(victim) => self.evict(victim),
                None => return Ok(None),
            }
        }
        if let Some(old) = replaced {
            let n = &mut self.nodes[old];
            self.used -= n.saved.as_ref().map_or(0, |s| s.bytes);
            self.used += saved.bytes;
            n.saved = Some(saved);
            return Ok(Some(old));
        }
        self.used += saved.bytes;
        let node = Node { parent, start, tokens: piece.to_vec(), saved: Some(saved), children: Vec::new(), last_used: self.clock };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id] = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.nodes[parent].children.push(id);
        Ok(Some(id))
    }

    fn ancestors(&self, mut node: usize) -> Vec<usize> {
        let mut out = vec![node];
        while node != ROOT {
            node = self.nodes[node].parent;
            out.push(node);
        }
        out
    }

    /// The least recently used piece without children, outside `protect` and not `keep`.
    fn least_recently_used(&self, protect: &[usize], keep: Option<usize>) -> Option<usize> {
        (1..self.nodes.len())
            .filter(|&i| self.nodes[i].saved.is_some() && self.nodes[i].children.is_empty())
            .filter(|i| !protect.contains(i) && Some(*i) != keep)
            .min_by_key(|&i| self.nodes[i].last_used)
    }

    fn evict(&mut self, id: usize) {
        let parent = self.nodes[id].parent;
        self.nodes[parent].children.retain(|&c| c != id);
        let n = &mut self.nodes[id];
        self.used -= n.saved.take().map_or(0, |s| s.bytes);
        n.tokens = Vec::new();
        self.free.push(id);
        self.evicted += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::PrefixCache;
    use std::sync::{Arc, Mutex};
    use crate::engine::lock;
    use crate::engine::{Device, Engine, EngineOptions, GenerateRequest, Generation};
    use crate::sampling::SamplingParams;

    const DENSE: &str = "qwen3_untied_gqa";
    const HYBRID: [&str; 2] = ["qwen3_5_tiny", "qwen3_5_moe_tiny"];

    /// A fixture model on the CPU with a prefix cache of blocks of 16 and states every 64.
    fn load(name: &str, budget: usize) -> Engine {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name);
        let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(512), ..EngineOptions::new(dir) };
        let mut engine = Engine::load(&opts, &mut |_| {}).unwrap();
        engine.prefix = Arc::new(Mutex::new(PrefixCache::with_geometry(budget, 16, 64)));
        engine
    }

    /// `n` token ids below 256 (every fixture's vocabulary), from `seed`.
    fn tokens(seed: u64, n: usize) -> Vec<u32> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 33) as u32 % 256
            })
            .collect()
    }

    /// Greedy, 12 tokens, with the top-3 log-probabilities of each (the logits, compared).
    fn run(engine: &mut Engine, prompt: &[u32]) -> Generation {
        let req = GenerateRequest {
            prompt: prompt.to_vec(),
            max_tokens: Some(12),
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: true,
            grammar: None,
            logprobs: Some(3),
        };
        engine.generate_raw(&req).unwrap()
    }

    /// The same request on a fresh engine without a prefix cache.
    fn alone(name: &str, prompt: &[u32]) -> Generation {
        run(&mut load(name, 0), prompt)
    }

    fn same(got: &Generation, want: &Generation, what: &str) {
        assert_eq!(got.tokens, want.tokens, "{what}: tokens");
        assert_eq!(got.logprobs, want.logprobs, "{what}: log-probabilities");
    }

    /// Conversation A's second turn re-sends its history (or an edited one) after conversation B
    /// took the live cache: A starts from its saved pieces and answers as if run alone.
    #[test]
    fn an_interrupted_conversation_resumes_from_its_saved_prefix() {
        for name in [DENSE, HYBRID[0], HYBRID[1]] {
            let recurrent = name != DENSE;
            let mut engine = load(name, 1 << 30);
            let a1 = tokens(1, 150);
            let first = run(&mut engine, &a1);
            run(&mut engine, &tokens(2, 170));
            // The turn's end: a recurrent model resumes exactly there, a dense one at its last
            // full block.
            let ran = a1.len() + first.tokens.len() - 1;
            let history = [a1.clone(), first.tokens.clone(), tokens(3, 40)].concat();
            let second = run(&mut engine, &history);
            let want = if recurrent { ran } else { ran / 16 * 16 };
            assert_eq!(second.cached_tokens, want, "{name}: history re-sent");
            same(&second, &alone(name, &history), name);

            // The answer edited out of the history (as chat templates drop reasoning): the end
            // of the first prompt is where its state was saved.
            run(&mut engine, &tokens(4, 90));
            let edited = [a1.clone(), tokens(5, 30)].concat();
            let third = run(&mut engine, &edited);
            let want = if recurrent { a1.len() } else { a1.len() / 16 * 16 };
            assert_eq!(third.cached_tokens, want, "{name}: history edited");
            same(&third, &alone(name, &edited), name);
        }
    }

    /// A long prompt saves recurrent states along the way: a prompt that leaves it part-way
    /// resumes from the last state before.
    #[test]
    fn long_prompts_leave_states_along_the_way() {
        for name in HYBRID {
            let mut engine = load(name, 1 << 30);
            let long = tokens(6, 300);
            run(&mut engine, &long);
            let branch = [&long[..200], &tokens(7, 20)].concat();
            let out = run(&mut engine, &branch);
            assert_eq!(out.cached_tokens, 192, "{name}");
            same(&out, &alone(name, &branch), name);
        }
    }

    /// With room for two conversations and a little, the least recently used pieces go and every
    /// answer stays the one computed alone.
    #[test]
    fn a_tiny_budget_evicts_and_stays_correct() {
        for name in [DENSE, HYBRID[0]] {
            let (a, b) = (tokens(9, 40), tokens(10, 45));
            let mut probe = load(name, 1 << 30);
            run(&mut probe, &a);
            let budget = lock(&probe.prefix).used() * 9 / 4;
            let mut engine = load(name, budget);
            let mut reused = 0;
            let mut turn = |prompt: &[u32]| {
                let out = run(&mut engine, prompt);
                reused += out.cached_tokens;
                same(&out, &alone(name, prompt), name);
                assert!(lock(&engine.prefix).used() <= budget, "{name}: {} bytes kept of {budget}", lock(&engine.prefix).used());
                [prompt, &out.tokens].concat()
            };
            // Two conversations, turn by turn, each re-sending its history.
            let a = turn(&a);
            let b = turn(&b);
            let a = turn(&[a, tokens(11, 5)].concat());
            turn(&[b, tokens(12, 6)].concat());
            turn(&[a, tokens(13, 4)].concat());
            assert!(reused > 0, "{name}: nothing was reused");
            assert!(lock(&engine.prefix).evicted() > 0, "{name}: nothing was evicted");
        }
    }

    /// Turned off, nothing is saved and the previous request's prefix is still reused.
    #[test]
    fn a_zero_budget_keeps_nothing() {
        let mut engine = load(DENSE, 0);
        let a = tokens(12, 100);
        let first = run(&mut engine, &a);
        let again = run(&mut engine, &[a.clone(), first.tokens.clone()].concat());
        assert_eq!(lock(&engine.prefix).len(), 0);
        assert_eq!(again.cached_tokens, a.len() + first.tokens.len() - 1);
    }
}
