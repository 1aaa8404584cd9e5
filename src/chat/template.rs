//! Renders a model's own Jinja chat template the way Hugging Face transformers does.
//!
//! transformers compiles chat templates with jinja2 (`trim_blocks`, `lstrip_blocks`, the
//! `loopcontrols` extension) and adds `raise_exception`, `strftime_now`, its own `tojson` filter and
//! a `{% generation %}` tag. The prompt a model was trained on is exactly that text, so every
//! difference here (a space after a JSON comma, `1e+16` vs `10000000000000000.0`) changes the
//! tokens the model sees.
//! The golden tests in `tests/chat_template.rs` compare against transformers byte for byte.

use std::borrow::Cow;
use std::fmt;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;

use minijinja::machinery::Token;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Serde, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State, Value};
use serde::Serialize;

use crate::{Error, Result};

/// The name the template is registered under. It has no file extension so that minijinja's
/// extension-based auto-escaping can never switch on.
const TEMPLATE_NAME: &str = "chat_template";

// A template comes with the model files, so it may be hostile: every render has a budget that
// ends it with an error, never a hang, an exhausted stack or an allocation that aborts the host.
/// minijinja fuel (about one per instruction and per BYTES_PER_FUEL bytes of data made or
/// printed) of every render (Qwen3's template spends under 1,000 on a six-message turn with tools;
/// a macro call is one instruction but costs far more than one, so this base stays low: spent on
/// a recursive macro tree it ends in a few ms here, in under a second under the fuzzer's
/// sanitizer, where 250,000 took 1.7 s)...
const RENDER_FUEL: u64 = 100_000;
/// ... plus this much per byte of the conversation, tools and kwargs, so the budget of a real
/// template grows with the request (a chat template spends about 1 per byte) ...
const RENDER_FUEL_PER_BYTE: u64 = 8;
/// ... up to this much, whatever the request.
const MAX_RENDER_FUEL: u64 = 50_000_000;
/// A template can nest a value once per loop iteration (`{% set ns.x = [ns.x] %}`, about 8 fuel
/// a level), and minijinja drops, compares and prints values recursively: the render runs on a
/// thread whose stack holds the deepest value its fuel can build (the pages are only touched as
/// deep as a template goes).
const RENDER_STACK_BYTES: usize = 1 << 30;
/// Text costs one fuel per this many bytes, each time it is made (tojson, str) and each time it
/// is printed: a macro's output is copied once per level of the calls above it, and those copies
/// are only bounded if printing them costs fuel (the fuzzer's 2^23-leaf macro tree, 2026-12-01).
const BYTES_PER_FUEL: u64 = 16;
/// Template recursion (minijinja's own measure: a macro call counts about 10, a block 1).
const RECURSION_LIMIT: usize = 250;
/// The most text one render, or one `tojson` / `string` inside it, may produce.
pub const MAX_RENDER_BYTES: usize = 64 << 20;
/// Nesting of the values `tojson` and `string` print (a template can nest lists in a loop).
const MAX_VALUE_DEPTH: usize = 128;
/// The largest template source accepted (real chat templates are under 50 KB).
const MAX_TEMPLATE_BYTES: usize = 1 << 20;
/// The most tokens one tag (`{{ ... }}`, `{% ... %}`) may hold. minijinja compiles an operator
/// chain by recursion, one stack frame pair per operator, and constant-folds it with a walk from
/// every node (quadratic in the chain): a 1 MB `{{ 1+1+...}}` overflowed the stack of the thread
/// that loaded it, and 16 KB of `x[:][:]...` took 10 s to render. The longest tag of the real
/// templates in tests/ is under 100 tokens.
const MAX_TAG_TOKENS: usize = 512;
/// A render that runs longer than this ends in an error. Fuel bounds the instructions a
/// template runs, but minijinja's lazy sequences (a slice of a slice of ..., `l + l` doubled)
/// iterate inside one instruction for free: 95 bytes of template kept a render busy for 44 s.
/// Such a render is abandoned: the request fails now, its thread finishes on its own, and while
/// an abandoned render of a template is still running no other render of it starts (so a hostile
/// template holds at most one core; other models' templates are not held up).
const RENDER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// A compiled chat template together with the special tokens transformers passes to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Renders of this template that passed their deadline and still run.
    abandoned: Arc<AtomicUsize>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// `source`: the Jinja text. `bos_token`/`eos_token`: the strings passed to the template as
    /// bos_token/eos_token ("" when None).
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        check_template_size(source)?;
        let env = build_environment(rewrite_generation_tags(source).into_owned())?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
            abandoned: Arc::default(),
        })
    }

    /// Reads the template from a HF model directory: `chat_template.jinja` if present, else
    /// tokenizer_config.json's `chat_template` (a string, or a list of {name, template} objects:
    /// "default", or the first), else a processor-style `chat_template.json`. bos_token/eos_token
    /// come from tokenizer_config.json (a string or an object with a "content" field).
    /// Returns Ok(None) when the directory has no template.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = match read_optional(&config_path)? {
            Some(text) => Some(parse_json_object(&config_path, &text)?),
            None => None,
        };
        let token = |key: &str| config.as_ref().and_then(|c| special_token(c.get(key)?));
        let (bos_token, eos_token) = (token("bos_token"), token("eos_token"));

        // transformers gives chat_template.jinja precedence over the copy in tokenizer_config.json.
        let jinja_path = dir.join("chat_template.jinja");
        let source = if let Some(text) = read_optional(&jinja_path)? {
            Some(text)
        } else if let Some(field) = config.as_ref().and_then(|c| c.get("chat_template")) {
            Some(template_from_field(&config_path, field)?)
        } else {
            let processor_path = dir.join("chat_template.json");
            match read_optional(&processor_path)? {
                Some(text) => match parse_json_object(&processor_path, &text)?.get("chat_template")
                {
                    Some(field) => Some(template_from_field(&processor_path, field)?),
                    None => None,
                },
                None => None,
            }
        };
        match source {
            Some(source) => ChatTemplate::new(&source, bos_token, eos_token).map(Some),
            None => Ok(None),
        }
    }

    /// Renders like transformers' `apply_chat_template(messages, tools=tools,
    /// add_generation_prompt=..., tokenize=False, **kwargs)`. `messages`: a JSON array of
    /// OpenAI-style messages; `tools`: JSON array or None; `kwargs`: extra variables such as
    /// enable_thinking.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        // Same variables as transformers: the special tokens, then the caller's kwargs (which may
        // override them), then the fixed arguments. `tools` and `documents` are always defined,
        // as None when absent, because that is what a Python keyword argument gives the template.
        const FIXED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];
        let mut ctx = serde_json::Map::new();
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        for (key, value) in kwargs {
            if FIXED.contains(&key.as_str()) {
                return Err(Error::InvalidRequest(format!(
                    "chat_template_kwargs {key:?} clashes with an argument of apply_chat_template"
                )));
            }
            ctx.insert(key.clone(), value.clone());
        }
        ctx.insert("messages".into(), normalize_messages(messages)?.into());
        ctx.insert(
            "tools".into(),
            tools.cloned().unwrap_or(serde_json::Value::Null),
        );
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());

        // The budget grows with what the template is given (serialising it once costs little).
        let mut counter = LimitedWriter::new(usize::MAX);
        serde_json::to_writer(&mut counter, &ctx).map_err(|e| Error::Template(e.to_string()))?;
        let fuel = RENDER_FUEL.saturating_add(RENDER_FUEL_PER_BYTE.saturating_mul(counter.written as u64));
        let mut env = self.env.clone();
        env.set_fuel(Some(fuel.min(MAX_RENDER_FUEL)));
        render_with_deadline(env, ctx, RENDER_DEADLINE, &self.abandoned)
    }
}

/// Renders on a thread of its own: its stack holds the deepest value the fuel can build, and the
/// caller stops waiting after `deadline` (see RENDER_DEADLINE). `abandoned` counts the renders
/// of the same template that passed it and still run.
fn render_with_deadline(
    env: Environment<'static>,
    ctx: serde_json::Map<String, serde_json::Value>,
    deadline: std::time::Duration,
    abandoned: &Arc<AtomicUsize>,
) -> Result<String> {
    if abandoned.load(Ordering::Acquire) > 0 {
        return Err(Error::Template(format!(
            "an earlier render of a chat template ran past its time limit ({deadline:?}) and is \
             still running; no other render starts until it ends"
        )));
    }
    let state = Arc::new(AtomicU8::new(RUNNING));
    let finish = RenderEnd { state: state.clone(), abandoned: abandoned.clone() };
    let (sender, receiver) = std::sync::mpsc::channel();
    let render = move || {
        let _finish = finish;
        let _ = sender.send(render_now(&env, &ctx));
    };
    let thread = std::thread::Builder::new().name("atlas-template".into()).stack_size(RENDER_STACK_BYTES);
    // Rendering on the caller's stack instead could overflow it (a fault no handler can report).
    let handle = thread.spawn(render).map_err(|e| {
        Error::Template(format!("cannot start the chat template's render thread ({RENDER_STACK_BYTES} bytes of stack): {e}"))
    })?;
    let received = match receiver.recv_timeout(deadline) {
        Ok(result) => return result,
        Err(RecvTimeoutError::Disconnected) => Err(std::sync::mpsc::RecvError),
        Err(RecvTimeoutError::Timeout) => {
            // Counted before it is marked, so that the thread's own decrement never comes first.
            abandoned.fetch_add(1, Ordering::AcqRel);
            if state.compare_exchange(RUNNING, ABANDONED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Err(Error::Template(format!(
                    "the chat template ran longer than {deadline:?}, the limit of one render"
                )));
            }
            // It finished just now.
            abandoned.fetch_sub(1, Ordering::AcqRel);
            receiver.recv()
        }
    };
    // No result: the render panicked (passed on) or ended otherwise.
    received.unwrap_or_else(|_| match handle.join() {
        Err(panic) => std::panic::resume_unwind(panic),
        Ok(()) => Err(Error::Template("the chat template's render thread ended without a result".into())),
    })
}

/// The states of a render thread.
const RUNNING: u8 = 0;
const FINISHED: u8 = 1;
const ABANDONED: u8 = 2;

/// Marks a render thread's end, however it ends (a panic too): the count of abandoned renders
/// drops when an abandoned one ends.
struct RenderEnd {
    state: Arc<AtomicU8>,
    abandoned: Arc<AtomicUsize>,
}

impl Drop for RenderEnd {
    fn drop(&mut self) {
        if self.state.compare_exchange(RUNNING, FINISHED, Ordering::AcqRel, Ordering::Acquire).is_err() {
            self.abandoned.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn render_now(env: &Environment<'static>, ctx: &serde_json::Map<String, serde_json::Value>) -> Result<String> {
    let template = env.get_template(TEMPLATE_NAME).map_err(template_error)?;
    let mut out = LimitedWriter::new(MAX_RENDER_BYTES);
    let rendered = template.render_captured_to(Serde(ctx), &mut out).map(drop);
    break_namespace_cycles();
    match rendered {
        Ok(()) => String::from_utf8(out.buf).map_err(|e| Error::Template(format!("the template wrote invalid UTF-8: {e}"))),
        Err(_) if out.exceeded => Err(too_large("the rendered prompt")),
        Err(err) => Err(template_error(err)),
    }
}

/// What transformers (5.x) does to the conversation before the template sees it: it rejects an
/// empty conversation, drops the top-level keys of each message whose value is None (APIs send
/// `content: null` or `tool_calls: null`, and templates handle a missing key better), and copies
/// a message's reasoning, whichever of `reasoning_content`, `thinking` or `reasoning` holds it, to
/// `reasoning_content` (what most templates read) and `thinking` (what gpt-oss reads).
fn normalize_messages(messages: &serde_json::Value) -> Result<Vec<serde_json::Value>> {
    const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
    let list = messages
        .as_array()
        .ok_or_else(|| Error::InvalidRequest("chat messages must be a JSON array".into()))?;
    if list.is_empty() {
        return Err(Error::InvalidRequest(
            "cannot apply a chat template to an empty conversation".into(),
        ));
    }
    list.iter()
        .map(|message| {
            let message = message.as_object().ok_or_else(|| {
                Error::InvalidRequest(format!("chat message must be a JSON object, got {message}"))
            })?;
            let mut kept: serde_json::Map<String, serde_json::Value> = message
                .iter()
                .filter(|(_, value)| !value.is_null())
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect();
            let reasoning = REASONING_FIELDS
                .iter()
                .find_map(|key| kept.get(*key))
                .cloned();
            if let Some(reasoning) = reasoning {
                // Python's `{"thinking": r, **message, "reasoning_content": r}`: `thinking` comes
                // first unless the message has its own, `reasoning_content` keeps its place.
                let mut aliased = serde_json::Map::with_capacity(kept.len() + 2);
                aliased.insert("thinking".into(), reasoning.clone());
                aliased.extend(std::mem::take(&mut kept));
                aliased.insert("reasoning_content".into(), reasoning);
                kept = aliased;
            }
            Ok(serde_json::Value::Object(kept))
        })
        .collect()
}

/// Collects (or only counts) bytes up to a limit; writing past it fails, which ends the render.
struct LimitedWriter {
    buf: Vec<u8>,
    written: usize,
    limit: usize,
    exceeded: bool,
}

impl LimitedWriter {
    /// `limit` usize::MAX counts without keeping anything.
    fn new(limit: usize) -> Self {
        LimitedWriter { buf: Vec::new(), written: 0, limit, exceeded: false }
    }
}

impl io::Write for LimitedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if data.len() > self.limit - self.written {
            self.exceeded = true;
            return Err(io::Error::other("output limit"));
        }
        self.written += data.len();
        if self.limit != usize::MAX {
            self.buf.extend_from_slice(data);
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn too_large(what: &str) -> Error {
    Error::Template(format!("{what} is larger than {MAX_RENDER_BYTES} bytes, the limit of a chat template's output"))
}

fn too_large_in_template(what: &str) -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{what} is larger than {MAX_RENDER_BYTES} bytes, the limit of a chat template's output"),
    )
}

/// jinja2 as transformers configures it.
fn syntax() -> Result<SyntaxConfig> {
    SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(template_error)
}

/// Refuses a template too large to compile in bounded time and stack (see MAX_TAG_TOKENS). A
/// syntax error is left for the compiler to report.
fn check_template_size(source: &str) -> Result<()> {
    if source.len() > MAX_TEMPLATE_BYTES {
        return Err(Error::Template(format!(
            "the chat template is {} bytes; the limit is {MAX_TEMPLATE_BYTES}",
            source.len()
        )));
    }
    let mut in_tag = 0usize;
    for token in minijinja::machinery::tokenize(source, false, syntax()?) {
        let Ok((token, span)) = token else { break };
        match token {
            Token::VariableStart | Token::BlockStart => in_tag = 1,
            Token::VariableEnd | Token::BlockEnd => in_tag = 0,
            _ if in_tag > 0 => {
                in_tag += 1;
                if in_tag > MAX_TAG_TOKENS {
                    return Err(Error::Template(format!(
                        "the chat template's tag on line {} has more than {MAX_TAG_TOKENS} tokens",
                        span.start_line
                    )));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn build_environment(source: String) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    env.set_recursion_limit(RECURSION_LIMIT);
    env.set_syntax(syntax()?);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson_filter);
    // `|string` is Python's str() in jinja2, so it must agree with what printing gives.
    env.add_filter("string", |state: &State, value: Value| py_str(Some(state), &value));
    // minijinja's pprint takes time quadratic in a value's depth: printed like str() instead.
    env.add_filter("pprint", |state: &State, value: Value| py_str(Some(state), &value));
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_function("namespace", tracked_namespace);
    env.add_template_owned(TEMPLATE_NAME, source)
        .map_err(template_error)?;
    Ok(env)
}

thread_local! {
    /// The namespaces a render on this thread has made, emptied when it ends.
    static NAMESPACES: std::cell::RefCell<Vec<Value>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// minijinja's `namespace()`, remembering what it made for `break_namespace_cycles`.
fn tracked_namespace(defaults: Option<minijinja::value::ValueOrKwargs>) -> std::result::Result<Value, minijinja::Error> {
    let ns = minijinja::functions::namespace(defaults)?;
    NAMESPACES.with(|made| made.borrow_mut().push(ns.clone()));
    Ok(ns)
}

/// A template can store a namespace inside itself (`{% set ns.me = ns %}`, or `ns|items`, a lazy
/// view of ns, in ns): a cycle of reference counts that minijinja never frees, so every render
/// of such a template leaked memory (found by the `chat_template` fuzz target). When a render
/// ends, every attribute that `{% set ns.name = ... %}` can have written in the namespaces it
/// made is set to none. Every cycle passes through such an assignment (a namespace's initial
/// values can only hold what existed before it), so none survives.
fn break_namespace_cycles() {
    let made = NAMESPACES.with(|made| std::mem::take(&mut *made.borrow_mut()));
    if made.is_empty() {
        return;
    }
    let identifier = |k: &str| k.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    let env = Environment::new();
    for ns in made {
        let Ok(keys) = ns.try_iter() else { continue };
        let clears: Vec<String> = keys.filter_map(|k| k.as_str().filter(|k| identifier(k)).map(|k| format!("{{% set ns.{k} = none %}}"))).collect();
        // One render for all; one each when a name does not parse as an attribute (a keyword).
        if env.render_str(&clears.concat(), minijinja::context! { ns => ns.clone() }).is_err() {
            for clear in &clears {
                let _ = env.render_str(clear, minijinja::context! { ns => ns.clone() });
            }
        }
    }
}

/// transformers' AssistantTracker adds `{% generation %}...{% endgeneration %}`, which marks the
/// assistant's text for training masks and otherwise just renders its body. minijinja has no such
/// tag, so it becomes an always-true `if` block, which keeps the tag's whitespace control intact.
fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let after_open = open + 2;
        let tag = &rest[after_open..];
        let marker_len = usize::from(tag.starts_with(['-', '+']));
        let word_start = after_open
            + marker_len
            + (tag[marker_len..].len() - tag[marker_len..].trim_start().len());
        let word = &rest[word_start..];
        let replacement = [("endgeneration", "endif"), ("generation", "if true")]
            .into_iter()
            .find(|(name, _)| {
                word.starts_with(name)
                    && word[name.len()..]
                        .starts_with(|c: char| c.is_whitespace() || matches!(c, '-' | '+' | '%'))
            });
        match replacement {
            Some((name, with)) => {
                out.push_str(&rest[..word_start]);
                out.push_str(with);
                rest = &rest[word_start + name.len()..];
            }
            None => {
                out.push_str(&rest[..after_open]);
                rest = &rest[after_open..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn template_error(err: minijinja::Error) -> Error {
    // A template's own raise_exception message is meant for the user: pass it on verbatim.
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedException>() {
            return Error::Template(raised.0.clone());
        }
        source = current.source();
    }
    Error::Template(err.to_string())
}

// ---------------------------------------------------------------------------------------------
// Model directory helpers

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(Error::io(path, err)),
    }
}

fn parse_json_object(
    path: &Path,
    text: &str,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::bad_file(path, "expected a JSON object")),
        Err(err) => Err(Error::bad_file(path, format!("invalid JSON: {err}"))),
    }
}

/// Special tokens are saved either as plain strings or as serialized `AddedToken` objects.
fn special_token(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(obj) => obj.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or (for models with several templates, e.g. a separate tool_use
/// one) a list of `{name, template}`; transformers uses "default" unless told otherwise.
fn template_from_field(path: &Path, field: &serde_json::Value) -> Result<String> {
    match field {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(list) => {
            let named = |entry: &serde_json::Value| {
                entry.get("name").and_then(|n| n.as_str()) == Some("default")
            };
            let entry = list
                .iter()
                .find(|e| named(e))
                .or_else(|| list.first())
                .ok_or_else(|| Error::bad_file(path, "chat_template is an empty list"))?;
            entry
                .get("template")
                .and_then(|t| t.as_str())
                .map(str::to_owned)
                .ok_or_else(|| {
                    Error::bad_file(path, "chat_template entry has no string \"template\"")
                })
        }
        _ => Err(Error::bad_file(
            path,
            "chat_template is neither a string nor a list",
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Globals transformers adds

/// Carried as the source of the minijinja error so that `render` can return the template's own
/// message rather than minijinja's decorated one.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn raise_exception(state: &State, message: Value) -> std::result::Result<Value, minijinja::Error> {
    let message = py_str(Some(state), &message)?;
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedException(message)),
    )
}

fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(&format, secs)
}

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Python's `strftime` for the C locale, in UTC (transformers uses local time; a server's local
/// time zone is rarely what a user means, and UTC keeps runs reproducible).
fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; Monday = 0
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(directive) = chars.next() else {
            out.push('%');
            break;
        };
        let piece = match directive {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'j' => format!("{day_of_year:03}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{hour12:02}"),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'A' => WEEKDAYS[weekday].to_string(),
            'a' => WEEKDAYS[weekday][..3].to_string(),
            'B' => month_name.to_string(),
            'b' | 'h' => month_name[..3].to_string(),
            'u' => (weekday + 1).to_string(),
            'w' => ((weekday + 1) % 7).to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            '%' => "%".to_string(),
            // glibc leaves unknown directives as they are.
            other => format!("%{other}"),
        };
        out.push_str(&piece);
    }
    out
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

// ---------------------------------------------------------------------------------------------
// Python's str() and repr(), which jinja2 uses to print values

/// Every printed value's text is charged to the render's fuel (BYTES_PER_FUEL).
/// jinja2 prints with Python's `str()`. minijinja 3 already spells None/True/False that way, but
/// prints containers with Rust's Debug (`["a", 1]`, and elided past a size limit) and floats
/// without exponents (`10000000000000000.0` for Python's `1e+16`), so those are printed here.
fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> std::result::Result<(), minijinja::Error> {
    if let Some(text) = value.as_str() {
        state.consume_fuel(text.len() as u64 / BYTES_PER_FUEL)?;
    }
    let pythonic = match value.kind() {
        ValueKind::Seq | ValueKind::Map => true,
        ValueKind::Number => !value.is_integer(),
        _ => false,
    };
    if pythonic {
        let text = py_str(Some(state), value)?;
        state.consume_fuel(text.len() as u64 / BYTES_PER_FUEL)?;
        out.write_str(&text).map_err(|_| minijinja::Error::from(ErrorKind::WriteFailure))
    } else {
        minijinja::escape_formatter(out, state, value)
    }
}

/// Python's str(); the items it visits are charged to the render's fuel when `state` is given.
fn py_str(state: Option<&State>, value: &Value) -> std::result::Result<String, minijinja::Error> {
    Ok(match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => {
            let mut out = String::new();
            write_py_repr(&mut out, value, 0, state)?;
            out
        }
    })
}

/// Python's repr() of `value` at nesting `depth`; fails past MAX_VALUE_DEPTH or MAX_RENDER_BYTES
/// (a template can nest a list a million deep in a loop, or repeat a long string in a long list).
fn write_py_repr(
    out: &mut String,
    value: &Value,
    depth: usize,
    state: Option<&State>,
) -> std::result::Result<(), minijinja::Error> {
    if let Some(state) = state {
        state.consume_fuel(1)?;
    }
    if depth > MAX_VALUE_DEPTH {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("a value nested more than {MAX_VALUE_DEPTH} deep cannot be printed"),
        ));
    }
    if out.len() > MAX_RENDER_BYTES {
        return Err(too_large_in_template("a printed value"));
    }
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => out.push_str(&py_float_repr(f)),
            Err(_) => out.push_str(&value.to_string()),
        },
        ValueKind::String => write_py_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut count = 0;
            if let Ok(items) = value.try_iter() {
                for item in items {
                    if count > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &item, depth + 1, state)?;
                    count += 1;
                }
            }
            if tuple && count == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &key, depth + 1, state)?;
                    out.push_str(": ");
                    write_py_repr(out, &value.get_item(&key).unwrap_or_default(), depth + 1, state)?;
                }
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`; non-printable
/// characters as `\x..`/`\u....`. Printability is approximated by the control, separator and
/// format characters that realistically occur in chat text.
fn write_py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_is_printable(c) => {
                let code = u32::from(c);
                if code <= 0xff {
                    out.push_str(&format!("\\x{code:02x}"));
                } else if code <= 0xffff {
                    out.push_str(&format!("\\u{code:04x}"));
                } else {
                    out.push_str(&format!("\\U{code:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn py_is_printable(c: char) -> bool {
    !matches!(u32::from(c),
        0x00..=0x1f | 0x7f..=0xa0 | 0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x1680 | 0x180e
        | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064 | 0x2066..=0x206f | 0x3000
        | 0xd800..=0xf8ff | 0xfeff | 0xfff9..=0xfffb | 0xe0001 | 0xe0020..=0xe007f
        | 0xf0000..=0x10ffff)
}

/// Python's `repr(float)`: the shortest digits that round-trip (as Rust's `{:e}` gives them),
/// laid out in exponent form when the decimal point would sit before 1e-4 or after 1e16.
fn py_float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.into();
    }
    let scientific = format!("{:e}", value.abs());
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // Python's decpt: the number of digits before the decimal point.
    let decpt = exponent + 1;

    let mut out = String::with_capacity(digits.len() + 8);
    if value.is_sign_negative() {
        out.push('-');
    }
    if decpt <= -4 || decpt > 16 {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push_str(&format!(
            "e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.abs()
        ));
    } else if decpt <= 0 {
        out.push_str("0.");
        out.push_str(&"0".repeat(decpt.unsigned_abs() as usize));
        out.push_str(&digits);
    } else {
        let decpt = decpt as usize;
        if decpt >= digits.len() {
            out.push_str(&digits);
            out.push_str(&"0".repeat(decpt - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt]);
            out.push('.');
            out.push_str(&digits[decpt..]);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// tojson: Python's json.dumps

/// transformers' filter: `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` returning `json.dumps(...)` with those arguments. Positional arguments bind
/// in that order, so `x|tojson(4)` sets ensure_ascii, not indent, exactly as in transformers.
fn tojson_filter(
    state: &State,
    value: &Value,
    positional: Rest<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let positional = positional.0;
    if positional.len() > NAMES.len() {
        return Err(minijinja::Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut bound: [Option<Value>; 4] = Default::default();
    for (slot, value) in bound.iter_mut().zip(positional) {
        *slot = Some(value);
    }
    for (slot, name) in bound.iter_mut().zip(NAMES) {
        if kwargs.has(name) {
            if slot.is_some() {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument {name:?}"),
                ));
            }
            *slot = Some(kwargs.get::<Value>(name)?);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = bound;
    let present = |v: &Option<Value>| {
        v.as_ref()
            .filter(|v| !v.is_none() && !v.is_undefined())
            .cloned()
    };

    let indent = match present(&indent) {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        // Python does `' ' * indent`, so True is one space and negative counts are no indent.
        Some(v) if v.kind() == ValueKind::Bool => Some(" ".repeat(usize::from(v.is_true()))),
        Some(v) => {
            let n = i64::try_from(v.clone()).map_err(|_| {
                minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson indent must be an integer or a string",
                )
            })?;
            let n = usize::try_from(n.max(0)).unwrap_or(usize::MAX);
            if n > MAX_RENDER_BYTES {
                return Err(too_large_in_template("the tojson indent"));
            }
            state.consume_fuel(n as u64 / BYTES_PER_FUEL)?;
            Some(" ".repeat(n))
        }
    };
    let (item_sep, key_sep) = match present(&separators) {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => (
                    item.as_str().unwrap_or_default().to_owned(),
                    key.as_str().unwrap_or_default().to_owned(),
                ),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be a pair of strings",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let options = DumpOptions {
        ensure_ascii: present(&ensure_ascii).is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: present(&sort_keys).is_some_and(|v| v.is_true()),
    };
    // serde recurses once per level: a value nested past the limit is refused before it.
    check_depth(state, value, 0)?;
    let json = serde_json::to_value(value).map_err(|err| {
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {err}"))
    })?;
    let text = py_json_dumps(&json, &options).map_err(|err| {
        if err.is_io() {
            return too_large_in_template("tojson's output");
        }
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {err}"))
    })?;
    state.consume_fuel(text.len() as u64 / BYTES_PER_FUEL)?;
    Ok(Value::from(text))
}

/// Fails when `value` nests deeper than MAX_VALUE_DEPTH; each item visited costs one fuel.
fn check_depth(state: &State, value: &Value, depth: usize) -> std::result::Result<(), minijinja::Error> {
    state.consume_fuel(1)?;
    if depth > MAX_VALUE_DEPTH {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: a value nested more than {MAX_VALUE_DEPTH} deep"),
        ));
    }
    match value.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            for item in value.try_iter()? {
                check_depth(state, &item, depth + 1)?;
            }
        }
        ValueKind::Map => {
            for key in value.try_iter()? {
                check_depth(state, &value.get_item(&key)?, depth + 1)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The parameters of `json.dumps` that change its output.
#[derive(Debug, Clone)]
struct DumpOptions {
    ensure_ascii: bool,
    /// The text repeated per level; None for single-line output.
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Default for DumpOptions {
    /// `json.dumps(x, ensure_ascii=False)`: what transformers' tojson does without arguments.
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

fn py_json_dumps(value: &serde_json::Value, options: &DumpOptions) -> serde_json::Result<String> {
    let sorted;
    let value = if options.sort_keys {
        sorted = sort_keys(value.clone());
        &sorted
    } else {
        value
    };
    let mut out = LimitedWriter::new(MAX_RENDER_BYTES);
    let formatter = PyJsonFormatter {
        options,
        depth: 0,
        has_value: false,
    };
    value.serialize(&mut serde_json::Serializer::with_formatter(
        &mut out, formatter,
    ))?;
    // The formatter only ever writes whole UTF-8 strings.
    String::from_utf8(out.buf)
        .map_err(|err| serde_json::Error::io(io::Error::new(io::ErrorKind::InvalidData, err)))
}

fn sort_keys(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().map(|(k, v)| (k, sort_keys(v))).collect();
            // Rust orders strings by UTF-8 bytes, which is Python's code point order.
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(entries.into_iter().collect())
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(sort_keys).collect())
        }
        other => other,
    }
}

/// Lays out JSON the way Python's `json` encoder does. serde_json already escapes exactly the
/// characters Python escapes with ensure_ascii=False (`"`, `\`, U+0000..U+001F, with the same
/// short forms and lowercase `\u00xx`); what differs is the whitespace, float spelling and
/// ensure_ascii.
struct PyJsonFormatter<'a> {
    options: &'a DumpOptions,
    depth: usize,
    has_value: bool,
}

impl PyJsonFormatter<'_> {
    fn newline_indent<W: ?Sized + io::Write>(&self, writer: &mut W) -> io::Result<()> {
        if let Some(indent) = &self.options.indent {
            writer.write_all(b"\n")?;
            for _ in 0..self.depth {
                writer.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }

    fn begin_item<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if !first {
            writer.write_all(self.options.item_sep.as_bytes())?;
        }
        self.newline_indent(writer)
    }

    fn open<W: ?Sized + io::Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        writer.write_all(bracket)
    }

    fn close<W: ?Sized + io::Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        // Python writes empty containers as `[]`/`{}` even when indenting.
        if self.has_value {
            self.newline_indent(writer)?;
        }
        writer.write_all(bracket)
    }
}

impl serde_json::ser::Formatter for PyJsonFormatter<'_> {
    fn write_f64<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f64) -> io::Result<()> {
        writer.write_all(py_float_repr(value).as_bytes())
    }

    fn write_f32<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f32) -> io::Result<()> {
        self.write_f64(writer, f64::from(value))
    }

    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        if !self.options.ensure_ascii {
            return writer.write_all(fragment.as_bytes());
        }
        // ensure_ascii escapes everything outside ' '..='~' (DEL included) as UTF-16 units.
        for c in fragment.chars() {
            if (' '..='~').contains(&c) {
                writer.write_all(&[c as u8])?;
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(writer, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }

    fn begin_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"[")
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"]")
    }

    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.begin_item(writer, first)
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, _writer: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"{")
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"}")
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.begin_item(writer, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(self.options.key_sep.as_bytes())
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, _writer: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render_str(source: &str, ctx: serde_json::Value) -> Result<String> {
        let template = ChatTemplate::new(source, None, None)?;
        let kwargs = ctx.as_object().cloned().unwrap_or_default();
        template.render(
            &json!([{"role": "user", "content": ""}]),
            None,
            false,
            &kwargs,
        )
    }

    fn dumps(value: serde_json::Value) -> String {
        py_json_dumps(&value, &DumpOptions::default()).unwrap()
    }

    // Expected strings below were produced by CPython 3.11's json.dumps.

    #[test]
    fn tojson_nested_keeps_insertion_order_and_python_spacing() {
        let value = json!({"z": 1, "a": [1, 2.5, {"k": null, "t": true}], "e": {}, "l": []});
        assert_eq!(
            dumps(value),
            r#"{"z": 1, "a": [1, 2.5, {"k": null, "t": true}], "e": {}, "l": []}"#
        );
    }

    #[test]
    fn tojson_unicode_is_not_escaped_and_html_is_left_alone() {
        let value = json!({"text": "é 中文 😀 <b>&'</b>"});
        assert_eq!(dumps(value), "{\"text\": \"é 中文 😀 <b>&'</b>\"}");
    }

    #[test]
    fn tojson_control_characters_match_python() {
        let value = json!("a\nb\tc\r\u{1}\u{8}\u{c}\u{1f}\u{7f}\"\\/");
        // python3 -c 'import json; print(json.dumps("a\nb\tc\r\x01\x08\x0c\x1f\x7f\"\\/", ensure_ascii=False))'
        assert_eq!(
            dumps(value),
            "\"a\\nb\\tc\\r\\u0001\\b\\f\\u001f\u{7f}\\\"\\\\/\""
        );
    }

    #[test]
    fn tojson_ensure_ascii_uses_lowercase_utf16_escapes() {
        let options = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        let out = py_json_dumps(&json!(["é中😀\u{7f}"]), &options).unwrap();
        assert_eq!(out, r#"["\u00e9\u4e2d\ud83d\ude00\u007f"]"#);
    }

    #[test]
    fn tojson_indent_matches_python() {
        let value = json!({"a": [1, {"b": []}], "c": {}, "d": "x"});
        let out = render_str("{{ v | tojson(indent=2) }}", json!({"v": value})).unwrap();
        // json.dumps(v, ensure_ascii=False, indent=2)
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    {\n      \"b\": []\n    }\n  ],\n  \"c\": {},\n  \"d\": \"x\"\n}");
        let out = render_str("{{ v | tojson(indent='\t') }}", json!({"v": [1]})).unwrap();
        assert_eq!(out, "[\n\t1\n]");
        let out = render_str("{{ v | tojson(indent=0) }}", json!({"v": [1, 2]})).unwrap();
        assert_eq!(out, "[\n1,\n2\n]");
    }

    #[test]
    fn tojson_arguments_bind_like_transformers() {
        let ctx = json!({"v": {"b": "é", "a": 1}});
        let out = render_str(
            "{{ v | tojson(sort_keys=true, separators=(',', ':')) }}",
            ctx.clone(),
        )
        .unwrap();
        assert_eq!(out, r#"{"a":1,"b":"é"}"#);
        // The first positional argument of transformers' tojson is ensure_ascii, not indent.
        let out = render_str("{{ v | tojson(4) }}", ctx.clone()).unwrap();
        assert_eq!(out, r#"{"b": "\u00e9", "a": 1}"#);
        assert!(render_str("{{ v | tojson(true, ensure_ascii=true) }}", ctx.clone()).is_err());
        assert!(render_str("{{ v | tojson(bogus=1) }}", ctx).is_err());
    }

    #[test]
    fn tojson_floats_are_spelled_like_python() {
        let value = json!([
            1.0,
            0.1,
            -2.5,
            1e16,
            1.5e16,
            1e15,
            0.0001,
            0.00001,
            1.2345e-7,
            123456789.125,
            -0.0,
            1e300
        ]);
        assert_eq!(
            dumps(value),
            "[1.0, 0.1, -2.5, 1e+16, 1.5e+16, 1000000000000000.0, 0.0001, 1e-05, 1.2345e-07, 123456789.125, -0.0, 1e+300]"
        );
    }

    #[test]
    fn raise_exception_fails_with_the_templates_message() {
        let err = render_str(
            "a{{ raise_exception('No user query found in messages.') }}b",
            json!({}),
        )
        .unwrap_err();
        match err {
            Error::Template(msg) => assert_eq!(msg, "No user query found in messages."),
            other => panic!("unexpected error {other:?}"),
        }
        // Also when raised inside a macro and a loop.
        let source = "{% macro m(x) %}{% if x > 1 %}{{ raise_exception('too big: ' ~ x) }}{% endif %}{% endmacro %}\
                      {% for i in [1, 2] %}{{ m(i) }}{% endfor %}";
        assert!(
            matches!(render_str(source, json!({})), Err(Error::Template(m)) if m == "too big: 2")
        );
    }

    #[test]
    fn syntax_errors_are_template_errors() {
        assert!(matches!(
            ChatTemplate::new("{% if %}", None, None),
            Err(Error::Template(_))
        ));
    }

    #[test]
    fn undefined_and_python_values_print_like_jinja2() {
        let out = render_str(
            "[{{ missing }}|{{ missing is defined }}|{{ n }}|{{ t }}|{{ f }}|{{ x }}|{{ l }}|{{ d }}|{{ n | string }}]",
            json!({"n": null, "t": true, "f": 1e16, "x": 2, "l": ["a", "it's", 1.5, null], "d": {"k": false}}),
        )
        .unwrap();
        assert_eq!(
            out,
            "[|False|None|True|1e+16|2|['a', \"it's\", 1.5, None]|{'k': False}|None]"
        );
        assert!(render_str("{{ missing.attr }}", json!({})).is_err());
        // minijinja's own Display would elide a long list; Python prints all of it.
        let long: Vec<u32> = (0..300).collect();
        let expected = format!("{long:?}");
        assert_eq!(
            render_str("{{ l }}", json!({ "l": long })).unwrap(),
            expected
        );
    }

    #[test]
    fn trim_blocks_lstrip_blocks_and_loop_controls() {
        let source = "{% for i in [1, 2, 3] %}\n  {% if i == 2 %}\n    {% continue %}\n  {% endif %}\n{{ i }}\n{% endfor %}\n";
        assert_eq!(render_str(source, json!({})).unwrap(), "1\n3\n");
    }

    #[test]
    fn python_string_methods_are_available() {
        let out = render_str(
            "{{ s.strip().startswith('a') }} {{ s.split(',')[1] }} {{ s.lstrip(' ').rstrip() }}",
            json!({"s": " a,b "}),
        )
        .unwrap();
        assert_eq!(out, "True b  a,b"); // split keeps the space: [' a', 'b ']
    }

    #[test]
    fn special_tokens_tools_and_kwargs_reach_the_template() {
        let template = ChatTemplate::new(
            "{{ bos_token }}|{{ eos_token }}|{{ tools is defined }}|{{ tools is none }}|{{ enable_thinking }}|{{ messages | length }}|{{ add_generation_prompt }}",
            Some("<s>".into()),
            None,
        )
        .unwrap();
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), json!(false));
        let out = template
            .render(
                &json!([{"role": "user", "content": "hi"}]),
                None,
                true,
                &kwargs,
            )
            .unwrap();
        assert_eq!(out, "<s>||True|True|False|1|True");
        kwargs.insert("messages".into(), json!([]));
        let messages = json!([{"role": "user", "content": "hi"}]);
        assert!(matches!(
            template.render(&messages, None, true, &kwargs),
            Err(Error::InvalidRequest(_))
        ));
    }

    #[test]
    fn messages_are_normalized_like_transformers() {
        let template = ChatTemplate::new("{{ messages | tojson }}", None, None).unwrap();
        let render = |messages: serde_json::Value| {
            template.render(&messages, None, false, &serde_json::Map::new())
        };
        // Python: {"thinking": r, **message, "reasoning_content": r} after dropping None values.
        let out = render(json!([
            {"role": "assistant", "content": "a", "tool_calls": null, "reasoning": "r"},
            {"role": "assistant", "reasoning_content": "x", "thinking": "t", "content": "b"},
            {"role": "user", "content": null},
        ]))
        .unwrap();
        assert_eq!(
            out,
            r#"[{"thinking": "r", "role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}, "#
                .to_owned()
                + r#"{"thinking": "t", "role": "assistant", "reasoning_content": "x", "content": "b"}, {"role": "user"}]"#
        );
        assert!(matches!(render(json!([])), Err(Error::InvalidRequest(_))));
        assert!(matches!(
            render(json!(["hi"])),
            Err(Error::InvalidRequest(_))
        ));
        assert!(matches!(
            render(json!({"role": "user"})),
            Err(Error::InvalidRequest(_))
        ));
    }

    #[test]
    fn generation_tags_render_their_body() {
        let source = "{% for m in messages %}\n{%- generation %}\n[{{ m.content }}]\n{%- endgeneration -%}\n{% endfor %}";
        let template = ChatTemplate::new(source, None, None).unwrap();
        let out = template
            .render(
                &json!([{"content": "a"}, {"content": "b"}]),
                None,
                false,
                &serde_json::Map::new(),
            )
            .unwrap();
        // jinja2 with transformers' AssistantTracker renders "[a][b]" for this template.
        assert_eq!(out, "[a][b]");
        assert_eq!(
            rewrite_generation_tags("{{ generation }}{%generation%}"),
            "{{ generation }}{%if true%}"
        );
    }

    #[test]
    fn strftime_matches_python() {
        // datetime.datetime(2024, 2, 29, 13, 5, 9, tzinfo=datetime.timezone.utc).timestamp() == 1709211909
        let out = strftime_utc(
            "%Y-%m-%d %H:%M:%S %a %A %b %B %j %I%p %y %% %e %w %u %q",
            1_709_211_909,
        );
        assert_eq!(
            out,
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 01PM 24 % 29 4 4 %q"
        );
        assert_eq!(strftime_utc("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime_utc("%Y-%m-%d %A", -86_400), "1969-12-31 Wednesday");
        assert_eq!(strftime_utc("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
        assert!(render_str("{{ strftime_now('%Y') }}", json!({}))
            .unwrap()
            .starts_with("20"));
    }

    #[test]
    fn model_dir_reads_config_list_templates_and_object_tokens() {
        let dir = std::env::temp_dir().join(format!("atlas-template-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(ChatTemplate::from_model_dir(&dir).unwrap().is_none());
        let config = json!({
            "bos_token": {"content": "<s>", "lstrip": false, "__type": "AddedToken"},
            "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ bos_token }}d{{ eos_token }}"}],
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let template = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(
            template
                .render(
                    &json!([{"role": "user"}]),
                    None,
                    false,
                    &serde_json::Map::new()
                )
                .unwrap(),
            "<s>d</s>"
        );
        // chat_template.jinja wins over the config's copy.
        std::fs::write(dir.join("chat_template.jinja"), "j{{ eos_token }}\n").unwrap();
        let template = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(
            template
                .render(
                    &json!([{"role": "user"}]),
                    None,
                    false,
                    &serde_json::Map::new()
                )
                .unwrap(),
            "j</s>"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Hostile templates (a model file brings its own) end in an error, quickly and without
    /// exhausting memory or the stack. Found by fuzz/fuzz_targets/chat_template.rs before any
    /// limit was set: endless loops, gigabytes of output, a list nested a million deep.
    /// Found by the chat_template fuzz target (a leak under LeakSanitizer): namespaces stored in
    /// themselves, directly or through `ns|items`, are emptied when the render ends.
    #[test]
    fn namespace_cycles_are_broken_after_a_render() {
        let found = "{% set ns = namespace(n=0, s='s') %}{% for m in messages[::-1] %}{% set ns.n = ns|items %}\
                     {% set ns.s = ns.s ~ m.role %}{% endfor %}{{ ns.x }}{{ ns.s|upper|unique }}";
        let env = build_environment(found.to_string()).unwrap();
        let messages = json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]);
        let out = env.get_template(TEMPLATE_NAME).unwrap().render(minijinja::context! { messages => Serde(&messages) }).unwrap();
        assert!(!out.is_empty());
        let self_held = "{% set ns = namespace(a=1) %}{% set ns.me = ns %}{% set ns.if_ = [ns] %}{{ ns.a }}";
        let env = build_environment(self_held.to_string()).unwrap();
        assert_eq!(env.get_template(TEMPLATE_NAME).unwrap().render(minijinja::context! {}).unwrap(), "1");
        let made: Vec<Value> = NAMESPACES.with(|m| m.borrow().clone());
        assert_eq!(made.len(), 2, "both renders' namespaces are tracked until broken");
        break_namespace_cycles();
        for ns in &made {
            for key in ns.try_iter().unwrap() {
                assert!(ns.get_item(&key).unwrap().is_none(), "{key} still holds a value");
            }
        }
        assert!(NAMESPACES.with(|m| m.borrow().is_empty()));
        // Through ChatTemplate::render, which breaks them itself.
        let template = ChatTemplate::new(self_held, None, None).unwrap();
        assert_eq!(template.render(&messages, None, false, &Default::default()).unwrap(), "1");
    }

    #[test]
    fn hostile_templates_end_in_errors() {
        let start = std::time::Instant::now();
        let cases = [
            // 10^10 iterations
            ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "fuel"),
            // 100 GB of output
            ("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}", "fuel"),
            // unbounded recursion
            ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
            // tojson's indent is Python's `' ' * indent`
            ("{{ messages|tojson(indent=1000000000000) }}", "larger than"),
            // a list nested 100,000 deep, then printed, serialised and stringified
            ("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|length }}", ""),
            ("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ (ns.x ~ '')|length }}", ""),
            ("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x == ns.x }}", ""),
            ("{% set ns = namespace(x=[]) %}{% for i in range(100) %}{% for j in range(10000) %}{% set ns.x = [ns.x] %}{% endfor %}{% endfor %}{{ ns.x|length }}", "fuel"),
            ("{% set ns = namespace(x=[]) %}{% for i in range(10000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|pprint }}", "nested"),
            ("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}", "nested"),
            ("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|tojson }}", "nested"),
            ("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|string }}", "nested"),
            // one long string printed many times inside a list (the fuel for the text made ends
            // it before the size limit: 100 MB is 6 million fuel)
            ("{% set s = 'x' * 10000000 %}{{ [s, s, s, s, s, s, s, s, s, s]|string }}", "fuel"),
            ("{% set s = 'x' * 1000000 %}{{ [s, s, s, s, s, s, s, s, s, s]|string|length }}", ""),
            // a macro calling itself twice, 2^23 leaves of indented JSON (the fuzzer's timeout of
            // 2026-12-01: 20 s under AddressSanitizer; docs/security.md)
            ("{% macro r(x, d) %}{% if d > 0 %}[{{ r(x, d - 1) }}]{{ r(x, d - 1) }}{% else %}{{ x|tojson(indent=4) }}{% endif %}{% endmacro %}{{ r(messages, 23) }}", "fuel"),
            ("{% macro r(x, d) %}{% if d > 0 %}[{{ r(x, d - 1) }}]{{ r(x, d - 1) }}{% else %}{{ x|tojson(indent=4) }}{% endif %}{% endmacro %}{{ r(range(200)|list, 23) }}", "fuel"),
            // the same tree over other leaves: the copies on the way up are charged as printed
            ("{% macro r(d) %}{% if d > 0 %}{{ r(d - 1) }}{{ r(d - 1) }}{% else %}{{ 'x' * 1000 }}{% endif %}{% endmacro %}{{ r(30) }}", "fuel"),
            ("{% macro r(d) %}{% if d > 0 %}{% set a = r(d - 1) %}{% set b = r(d - 1) %}{{ a ~ b }}{% else %}{{ 'x' * 1000 }}{% endif %}{% endmacro %}{{ r(30)|length }}", "fuel"),
            // a string doubled in a loop
            ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}", "fuel"),
        ];
        for (source, needle) in cases {
            let t = std::time::Instant::now();
            match render_str(source, json!({})) {
                Ok(out) => assert!(needle.is_empty() && out.len() < 10_000_000, "{source} rendered {} bytes", out.len()),
                Err(e) => assert!(e.to_string().contains(needle), "{source}: {e}"),
            }
            assert!(t.elapsed().as_secs() < 10, "{source} took {:?}", t.elapsed());
        }
        assert!(start.elapsed().as_secs() < 30);
    }

    /// Templates whose compilation would take unbounded time or stack are refused before it.
    #[test]
    fn templates_too_large_to_compile_are_refused() {
        let chain = format!("{{{{ 1{} }}}}", "+1".repeat(500_000));
        let err = ChatTemplate::new(&chain, None, None).unwrap_err().to_string();
        assert!(err.contains("more than 512 tokens"), "{err}");
        let slices = format!("{{{{ x{} }}}}", "[:]".repeat(5_000));
        let err = ChatTemplate::new(&slices, None, None).unwrap_err().to_string();
        assert!(err.contains("line 1 has more than 512 tokens"), "{err}");
        let statement = format!("{{% set y = 1{} %}}", "+1".repeat(600));
        assert!(ChatTemplate::new(&statement, None, None).is_err());
        let huge = format!("{{# {} #}}", "x".repeat(MAX_TEMPLATE_BYTES));
        let err = ChatTemplate::new(&huge, None, None).unwrap_err().to_string();
        assert!(err.contains("the limit is 1048576"), "{err}");
        // Many short tags are fine, and text outside tags is not counted.
        let long = format!("{}{}", "{{ 1+1+1 }}".repeat(10_000), "text ".repeat(10_000));
        assert!(ChatTemplate::new(&long, None, None).is_ok());
        assert!(render_str(&format!("{{{{ 1{} }}}}", "+1".repeat(250)), json!({})).unwrap() == "251");
    }

    /// A render that outlives its deadline fails at once; while it runs on, other renders of the
    /// same template are refused (another template's are not), and once it ends they run again. The hostile template nests 12,000 lazy slices over a
    /// range: fuel counts the loop, not the 3,000 x 12,000 steps of `length`.
    #[test]
    fn a_render_past_its_deadline_is_abandoned() {
        let abandoned = Arc::new(AtomicUsize::new(0));
        let hang = "{% set ns = namespace(x=range(3000)) %}{% for i in range(12000) %}{% set ns.x = ns.x[:] %}{% endfor %}{{ ns.x|length }}";
        let render = |source: &str, deadline_ms: u64| {
            let mut env = build_environment(source.to_string()).unwrap();
            env.set_fuel(Some(RENDER_FUEL));
            render_with_deadline(env, serde_json::Map::new(), std::time::Duration::from_millis(deadline_ms), &abandoned)
        };
        let start = std::time::Instant::now();
        let err = render(hang, 50).unwrap_err().to_string();
        assert!(err.contains("ran longer than 50ms"), "{err}");
        assert!(start.elapsed().as_millis() < 1_000);
        let err = render("fine", 1_000).unwrap_err().to_string();
        assert!(err.contains("still running"), "{err}");
        let other = build_environment("other".into()).unwrap();
        assert_eq!(render_with_deadline(other, serde_json::Map::new(), std::time::Duration::from_secs(5), &Arc::default()).unwrap(), "other");
        while abandoned.load(Ordering::Acquire) > 0 {
            assert!(start.elapsed().as_secs() < 120, "the abandoned render never ended");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(render("fine", 1_000).unwrap(), "fine");
    }

    /// The budget grows with the request: a long real conversation still renders.
    #[test]
    fn a_long_conversation_fits_the_budget() {
        let source = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|trim }}<|im_end|>\n{% endfor %}";
        let template = ChatTemplate::new(source, None, None).unwrap();
        let messages: Vec<serde_json::Value> =
            (0..100_000).map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi"})).collect();
        let out = template.render(&json!(messages), None, false, &serde_json::Map::new()).unwrap();
        assert_eq!(out.len(), 50_000 * 30 + 50_000 * 35);
    }
}
