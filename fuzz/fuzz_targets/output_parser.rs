//! The model's streamed answer as the tool-call / reasoning parser sees it (`OutputParser::push`
//! per piece, then `finish`), split into pieces at positions the input chooses. A generated text
//! is untrusted: a prompt can make the model write anything. Checked: no panic, and the same
//! reasoning, content and tool calls whichever way the text was split.
#![no_main]

use std::sync::OnceLock;

use atlas::chat::output::{Delta, OutputParser};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

fn tools() -> &'static Value {
    static T: OnceLock<Value> = OnceLock::new();
    T.get_or_init(|| {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])
    })
}

/// Consecutive deltas of one kind joined, so different splits compare equal.
fn merged(deltas: Vec<Delta>) -> Vec<Delta> {
    let mut out: Vec<Delta> = Vec::new();
    for d in deltas {
        match (out.last_mut(), d) {
            (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
            (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
            (_, d) => out.push(d),
        }
    }
    out
}

fn run(flags: u8, pieces: &[&str]) -> Vec<Delta> {
    let tools = (flags & 2 != 0).then(tools);
    let mut p = OutputParser::new(flags & 1 != 0, tools);
    if flags & 4 != 0 {
        p.start_in_tool_call("\n{\"name\": \"get_weather\", \"arguments\": ");
    }
    let mut out: Vec<Delta> = pieces.iter().flat_map(|s| p.push(s)).collect();
    out.extend(p.finish());
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    // Cut points: the low bits of the flag byte's neighbours would bias them; take a second byte.
    let Some((&cuts_seed, rest)) = rest.split_first() else { return };
    let text = String::from_utf8_lossy(rest);
    let whole = merged(run(flags, &[&text]));
    // Split into pieces whose lengths follow the seed (1..=16 bytes, moved to char boundaries).
    let mut pieces = Vec::new();
    let (mut at, mut s) = (0usize, cuts_seed as usize | 1);
    while at < text.len() {
        s = s.wrapping_mul(1103515245).wrapping_add(12345) & 0x7fff_ffff;
        let mut end = (at + 1 + (s >> 16) % 16).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        pieces.push(&text[at..end]);
        at = end;
    }
    let split = merged(run(flags, &pieces));
    assert_eq!(split, whole, "splitting the text changed the parse: {pieces:?}");
});
