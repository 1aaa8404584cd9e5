//! Stop strings over streamed text: text that could still become a stop string is held back, so a
//! stop string never reaches the client, not even in part.

use crate::chat::output::partial_suffix_len;

pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

pub enum StopOutcome {
    /// Text that is safe to emit now (maybe empty).
    Continue(String),
    /// A stop string was found: the text before it, and generation ends.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new() }
    }

    pub fn push(&mut self, piece: &str) -> StopOutcome {
        self.pending.push_str(piece);
        let earliest = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min();
        if let Some(at) = earliest {
            let before = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(before);
        }
        let hold = self.longest_partial_suffix();
        let emit_to = self.pending.len() - hold;
        let out = self.pending[..emit_to].to_string();
        self.pending.drain(..emit_to);
        StopOutcome::Continue(out)
    }

    /// Whatever was held back, once generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    fn longest_partial_suffix(&self) -> usize {
        let stops: Vec<&str> = self.stops.iter().map(String::as_str).collect();
        partial_suffix_len(&self.pending, &stops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_split_across_pieces_is_cut_and_never_emitted() {
        assert_eq!(run(&["END"], &["hello E", "N", "D more"]), ("hello ".into(), true));
    }

    #[test]
    fn partial_match_that_fails_is_released() {
        assert_eq!(run(&["END"], &["an E", "NQ"]), ("an ENQ".into(), false));
        assert_eq!(run(&["END"], &["tail E"]), ("tail E".into(), false));
    }

    #[test]
    fn earliest_stop_wins_and_unicode_is_safe() {
        assert_eq!(run(&["b", "a"], &["xxab"]), ("xx".into(), true));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
