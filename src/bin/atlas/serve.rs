//! `atlas serve`: an OpenAI-compatible HTTP server over one loaded model.
//!
//! A request is parsed, rendered and tokenized on a blocking thread before it asks for an engine,
//! so a malformed or oversized prompt is refused without waiting for (or holding) one. The model
//! has one engine per sequence slot (`--parallel`); their decode steps run batched. Requests take
//! a free engine first come, first served (a fair semaphore), and a request whose client leaves
//! while it waits drops out of the queue with its handler. Each completion then runs on a
//! blocking thread.
//!
//! Streamed chunks travel from that thread to the client through a backlog bounded by chunks and by
//! bytes. When it is full generation waits for the client; a client that takes nothing for
//! --stream-timeout has its request cancelled, so that one that stopped reading cannot hold the
//! engine. When the client goes away the backlog closes, the chunk callback returns false and
//! generation stops at the next token. A non-streamed request whose client goes away is cancelled
//! the same way, through a flag set when its handler is dropped.

use std::convert::Infallible;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use atlas::api::{self, Endpoint, Prepared, DEFAULT_MAX_REQUEST_BYTES};
use atlas::engine::Frontend;
use atlas::{Engine, EngineOptions, Error, Result};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};

use crate::LoadArgs;

/// A stream holds at most this many chunks for a slow client before generation waits for it...
const STREAM_CHUNKS: usize = 256;
/// ...and at most this many bytes, however large the chunks.
const STREAM_BYTES: usize = 4 << 20;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    load: LoadArgs,
    /// Address to listen on. The default accepts connections from this machine only; 0.0.0.0
    /// (or ::) accepts them from the network, so set --api-key then.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one (the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint except /health (401 otherwise).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Cancel a streamed answer once generation has waited this long for its client to read
    /// anything (its buffers full), freeing the engine for the requests queued behind it. A client
    /// that keeps reading, however slowly, is waited for.
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    stream_timeout: u64,
    /// Largest request body accepted, in bytes (413 beyond it).
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_MAX_REQUEST_BYTES)]
    max_request_bytes: usize,
}

struct Server {
    /// Set once the model has loaded; until then the API answers 503.
    loaded: OnceLock<Loaded>,
    api_key: Option<String>,
    max_request_bytes: usize,
    stream_timeout: Duration,
}

struct Loaded {
    engines: Arc<Engines>,
    /// The template and tokenizer, to prepare requests without the engine.
    frontend: Frontend,
    model: String,
    created: u64,
}

/// The model's engines, one per sequence slot (`--parallel`): a request takes one for its
/// generation and gives it back at the end. Fair: requests get them in the order they asked.
struct Engines {
    free: Mutex<Vec<Engine>>,
    permits: Arc<tokio::sync::Semaphore>,
}

impl Engines {
    fn new(engines: Vec<Engine>) -> Arc<Self> {
        let permits = Arc::new(tokio::sync::Semaphore::new(engines.len()));
        Arc::new(Engines { free: Mutex::new(engines), permits })
    }

    /// Waits for a free engine. A client that leaves while waiting drops its place.
    async fn take(self: &Arc<Self>) -> Result<Lease, ApiError> {
        let permit = self.permits.clone().acquire_owned().await.map_err(|e| ApiError::internal(format!("no engine: {e}")))?;
        let engine = lock(&self.free).pop().ok_or_else(|| ApiError::internal("a permit without a free engine"))?;
        Ok(Lease { engine: Some(engine), engines: self.clone(), _permit: permit })
    }
}

/// An engine held by one request.
struct Lease {
    engine: Option<Engine>,
    engines: Arc<Engines>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl std::ops::Deref for Lease {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        self.engine.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut Engine {
        self.engine.as_mut().expect("held until dropped")
    }
}

impl Drop for Lease {
    /// Back among the free engines before the permit (a field, dropped after this) lets the next
    /// request look for one.
    fn drop(&mut self) {
        if let Some(engine) = self.engine.take() {
            lock(&self.engines.free).push(engine);
        }
    }
}

/// An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}` with its HTTP status.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, code, message: message.into() }
    }

    fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_request", message)
    }

    fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message)
    }

    fn loading() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", "model_loading", "the model is still loading")
    }

    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": self.code}})
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let message = e.to_string();
        match e {
            Error::InvalidRequest(_) | Error::Template(_) | Error::InvalidArgument(_) => ApiError::invalid(message),
            Error::Unsupported(_) => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", "unsupported", message)
            }
            Error::ContextOverflow(_) => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", "context_length_exceeded", message)
            }
            Error::Cancelled => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "cancelled", message),
            Error::CacheFull(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "kv_cache_full", message),
            _ => ApiError::internal(message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, &self.body())
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

pub fn run(args: &ServeArgs) -> Result<()> {
    // Check the model directory and device before taking the port.
    let mut opts = args.load.options()?;
    opts.parallel = args.load.parallel_or(0);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("atlas-http")
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))?;
    let result = runtime.block_on(serve(args, opts));
    // A model still loading when the server stopped is not waited for.
    runtime.shutdown_timeout(Duration::from_millis(200));
    result
}

async fn serve(args: &ServeArgs, opts: EngineOptions) -> Result<()> {
    let mut signals = Signals::install()?;
    let addr = format_addr(&args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| Error::io(&addr, e))?;
    let local = listener.local_addr().map_err(|e| Error::io(&addr, e))?;
    eprintln!("listening on http://{local} (loading the model; the API answers 503 until it is ready)");

    let server = Arc::new(Server {
        loaded: OnceLock::new(),
        api_key: args.api_key.clone(),
        max_request_bytes: args.max_request_bytes,
        stream_timeout: Duration::from_secs(args.stream_timeout),
    });
    let (failed_tx, failed_rx) = oneshot::channel::<Error>();
    let loading = server.clone();
    tokio::task::spawn_blocking(move || match crate::load_engine(&opts).and_then(|e| Ok((e.model_name(), e.frontend().clone(), e.split()?))) {
        Ok((model, frontend, engines)) => {
            let parallel = engines.len();
            let loaded = Loaded {
                frontend,
                engines: Engines::new(engines),
                model: model.clone(),
                created: unix_time(),
            };
            let _ = loading.loaded.set(loaded);
            eprintln!("ready: model {model:?} at http://{local}/v1 ({parallel} at once)");
        }
        Err(e) => {
            let _ = failed_tx.send(e);
        }
    });

    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/completions", post(text_completions))
        .route("/completions", post(text_completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(server);

    let load_error = Arc::new(Mutex::new(None));
    let stop = {
        let load_error = load_error.clone();
        async move {
            tokio::select! {
                _ = signals.recv() => {
                    eprintln!("shutting down: finishing the requests in flight (Ctrl-C again to stop now)");
                    tokio::spawn(async move {
                        signals.recv().await;
                        eprintln!("stopped");
                        std::process::exit(130);
                    });
                }
                Ok(e) = failed_rx => {
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }
        }
    };
    axum::serve(listener, app).with_graceful_shutdown(stop).await.map_err(|e| Error::io(&addr, e))?;
    let failed = load_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    match failed {
        Some(e) => Err(e),
        None => {
            eprintln!("stopped");
            Ok(())
        }
    }
}

fn format_addr(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Ctrl-C, and SIGTERM on Unix. The handlers are installed when this is made, so a signal that
/// comes before the server runs is not lost.
struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let io = |e| Error::io("signal handler", e);
            Ok(Signals {
                interrupt: signal(SignalKind::interrupt()).map_err(io)?,
                terminate: signal(SignalKind::terminate()).map_err(io)?,
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

impl Server {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        match given {
            Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
            Some(_) => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "invalid_api_key",
                "invalid API key",
            )),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "invalid_api_key",
                "missing API key: send the header Authorization: Bearer <key>",
            )),
        }
    }

    fn ready(&self) -> Result<&Loaded, ApiError> {
        self.loaded.get().ok_or_else(ApiError::loading)
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health(State(server): State<Arc<Server>>) -> Response {
    match server.ready() {
        Ok(_) => json_response(StatusCode::OK, &json!({"status": "ok"})),
        Err(e) => e.into_response(),
    }
}

async fn models(State(server): State<Arc<Server>>, headers: HeaderMap) -> Result<Response, ApiError> {
    server.authorize(&headers)?;
    let loaded = server.ready()?;
    let model = json!({"id": loaded.model, "object": "model", "created": loaded.created, "owned_by": "atlas"});
    Ok(json_response(StatusCode::OK, &json!({"object": "list", "data": [model]})))
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "not_found",
        "no such endpoint (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health)",
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method_not_allowed", "method not allowed")
}

/// What the generating thread sends to a streaming response.
enum Event {
    Chunk(String),
    Done(Result<Value, ApiError>),
}

impl Event {
    /// What the event weighs in a stream's backlog.
    fn bytes(&self) -> usize {
        match self {
            Event::Chunk(c) => c.len(),
            Event::Done(_) => 0,
        }
    }
}

/// Why a client no longer takes its answer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Gone {
    Left,
    /// It took nothing from its full stream for this long.
    Stalled(Duration),
}

/// Sets the flag when dropped: the handler of a non-streamed request was dropped (its client went
/// away) or finished.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

async fn chat_completions(state: State<Arc<Server>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    completions(Endpoint::Chat, state, headers, body).await
}

async fn text_completions(state: State<Arc<Server>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    completions(Endpoint::Text, state, headers, body).await
}

async fn completions(
    endpoint: Endpoint,
    State(server): State<Arc<Server>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    server.authorize(&headers)?;
    let loaded = server.ready()?;
    let bytes = read_body(&headers, body, server.max_request_bytes).await?;
    let frontend = loaded.frontend.clone();
    let (prepared, streaming) = tokio::task::spawn_blocking(move || prepare(&frontend, endpoint, &bytes))
        .await
        .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))??;
    // The queue: a client that leaves while waiting here drops this handler, and its place with it.
    let engine = loaded.engines.take().await?;
    if streaming {
        stream_completion(engine, endpoint, prepared, server.stream_timeout).await
    } else {
        let cancelled = Arc::new(AtomicBool::new(false));
        let _guard = CancelOnDrop(cancelled.clone());
        let job = tokio::task::spawn_blocking(move || {
            let mut engine = engine;
            let mut on_chunk = |_: &str| if cancelled.load(Ordering::Relaxed) { Err(Gone::Left) } else { Ok(()) };
            run_completion(&mut engine, endpoint, prepared, &mut on_chunk)
        });
        let answer = job.await.map_err(|e| ApiError::internal(format!("the request failed: {e}")))??;
        Ok(json_response(StatusCode::OK, &answer))
    }
}

async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large(limit));
    }
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        if e.to_string().contains("length limit") {
            too_large(limit)
        } else {
            ApiError::invalid(format!("could not read the request body: {e}"))
        }
    })
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        "request_too_large",
        format!("the request body is larger than {limit} bytes"),
    )
}

/// Parses a request and renders and tokenizes its prompt, all without the engine; also returns
/// whether the client asked for a stream. The prepared request always streams, so that its chunks
/// flow through the callback and a vanished client cancels it either way.
fn prepare(frontend: &Frontend, endpoint: Endpoint, body: &[u8]) -> Result<(Prepared, bool), ApiError> {
    let text =
        std::str::from_utf8(body).map_err(|e| ApiError::invalid(format!("the request body is not UTF-8: {e}")))?;
    let prepared = api::prepare(frontend, endpoint, text).map(|mut p| {
        let streaming = p.stream_always();
        (p, streaming)
    });
    prepared.map_err(|e| {
        eprintln!("rejected a request: {e}");
        ApiError::from(e)
    })
}

/// Runs one completion on the calling (blocking) thread. `on_chunk` fails once the client is gone,
/// and generation then stops at the next token.
fn run_completion(
    engine: &mut Engine,
    endpoint: Endpoint,
    prepared: Prepared,
    on_chunk: &mut dyn FnMut(&str) -> Result<(), Gone>,
) -> Result<Value, ApiError> {
    let mut gone = None;
    let mut sink = |chunk: &str| match on_chunk(chunk) {
        Ok(()) => true,
        Err(why) => {
            gone = Some(why);
            false
        }
    };
    let start = Instant::now();
    let result = catch_unwind(AssertUnwindSafe(|| api::run(engine, prepared, &mut sink)));
    let what = endpoint.name();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(Ok(answer)) => {
            let usage = &answer["usage"];
            eprintln!(
                "{what}: {} prompt tokens ({} cached), {} generated, finish {}, {ms:.0} ms",
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
                usage["completion_tokens"],
                answer["choices"][0]["finish_reason"],
            );
            Ok(answer)
        }
        Ok(Err(Error::Cancelled)) => {
            let why = match gone {
                Some(Gone::Stalled(t)) => {
                    format!("the client took nothing from its stream for {} s (--stream-timeout)", t.as_secs())
                }
                _ => "the client went away".to_string(),
            };
            eprintln!("{what} cancelled after {ms:.0} ms: {why}");
            Err(Error::Cancelled.into())
        }
        Ok(Err(e)) => {
            eprintln!("{what} failed: {e}");
            Err(e.into())
        }
        Err(panic) => {
            engine.reset_cache();
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            eprintln!("{} panicked: {what}", endpoint.name());
            Err(ApiError::internal(format!("internal error: {what}")))
        }
    }
}

/// Server-sent events: `data: {chunk}` per chunk, then `data: [DONE]`. The response waits for the
/// generation's second event (a chat's first delta after the role chunk; a text completion's
/// second piece) or its end, so that errors found before any token still get an HTTP status.
async fn stream_completion(
    engine: Lease,
    endpoint: Endpoint,
    prepared: Prepared,
    stall: Duration,
) -> Result<Response, ApiError> {
    let backlog = Arc::new(Backlog::default());
    let (tx, rx) = mpsc::unbounded_channel::<Event>();
    let mut reader = BacklogReader { rx, backlog: backlog.clone() };
    let mut sender = ChunkSender { tx, backlog, stall, gone: None };
    tokio::task::spawn_blocking(move || {
        let mut engine = engine;
        let result = run_completion(&mut engine, endpoint, prepared, &mut |chunk| sender.send(Event::Chunk(chunk.to_string())));
        // The next request need not wait for this client to take the end of its answer.
        drop(engine);
        let _ = sender.send(Event::Done(result));
    });

    let mut head = Vec::new();
    loop {
        match reader.next().await {
            Some(Event::Chunk(c)) => {
                head.push(Event::Chunk(c));
                if head.len() >= 2 {
                    break;
                }
            }
            Some(Event::Done(Err(e))) => return Err(e),
            Some(done @ Event::Done(Ok(_))) => {
                head.push(done);
                break;
            }
            None => return Err(ApiError::internal("the generation stopped without an answer")),
        }
    }
    let events = tokio_stream::iter(head).chain(reader);
    let body = Body::from_stream(events.map(|event| Ok::<Bytes, Infallible>(sse_bytes(event))));
    let mut response = Response::new(body);
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// What a stream holds for its client: the generating thread waits while it is full, and gives up
/// on a client that takes nothing. A full TCP window looks the same whether the client is slow or
/// has stopped reading, so only a stretch with no progress at all counts as a stall.
#[derive(Default)]
struct Backlog {
    held: Mutex<Held>,
    /// Signalled when the client takes an event or goes away.
    changed: Condvar,
}

#[derive(Default)]
struct Held {
    events: usize,
    bytes: usize,
    /// The client went away.
    closed: bool,
}

impl Backlog {
    /// Makes room for one more event of `bytes`, waiting while the backlog is full; fails once the
    /// client has gone, or has taken nothing for `stall`. An event alone always fits, however large.
    fn admit(&self, bytes: usize, stall: Duration) -> Result<(), Gone> {
        let mut held = lock(&self.held);
        let mut timed_out = false;
        loop {
            if held.closed {
                return Err(Gone::Left);
            }
            let fits = held.events < STREAM_CHUNKS && held.bytes.saturating_add(bytes) <= STREAM_BYTES;
            if fits || held.events == 0 {
                held.events += 1;
                held.bytes += bytes;
                return Ok(());
            }
            if timed_out {
                return Err(Gone::Stalled(stall));
            }
            // Each event taken starts the wait over: a slow client is waited for.
            let (next, wait) = self.changed.wait_timeout(held, stall).unwrap_or_else(PoisonError::into_inner);
            held = next;
            timed_out = wait.timed_out();
        }
    }

    fn taken(&self, bytes: usize) {
        let mut held = lock(&self.held);
        held.events = held.events.saturating_sub(1);
        held.bytes = held.bytes.saturating_sub(bytes);
        drop(held);
        self.changed.notify_one();
    }

    fn close(&self) {
        lock(&self.held).closed = true;
        self.changed.notify_one();
    }
}

/// The counts stay meaningful whatever panicked while holding them.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The generating thread's end of a stream.
struct ChunkSender {
    tx: mpsc::UnboundedSender<Event>,
    backlog: Arc<Backlog>,
    stall: Duration,
    /// Set on the first failure, so that later events (the end) do not wait for the client again.
    gone: Option<Gone>,
}

impl ChunkSender {
    fn send(&mut self, event: Event) -> Result<(), Gone> {
        if let Some(gone) = self.gone {
            return Err(gone);
        }
        let sent =
            self.backlog.admit(event.bytes(), self.stall).and_then(|()| self.tx.send(event).map_err(|_| Gone::Left));
        self.gone = sent.err();
        sent
    }
}

/// The response's end of a stream: each event the client takes leaves the backlog, and dropping it
/// (the client went away) closes the backlog.
struct BacklogReader {
    rx: mpsc::UnboundedReceiver<Event>,
    backlog: Arc<Backlog>,
}

impl Stream for BacklogReader {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let polled = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(event)) = &polled {
            self.backlog.taken(event.bytes());
        }
        polled
    }
}

impl Drop for BacklogReader {
    fn drop(&mut self) {
        self.backlog.close();
    }
}

fn sse_bytes(event: Event) -> Bytes {
    match event {
        Event::Chunk(c) => Bytes::from(format!("data: {c}\n\n")),
        Event::Done(Ok(_)) => Bytes::from_static(b"data: [DONE]\n\n"),
        Event::Done(Err(e)) => Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", e.body())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_openai_statuses() {
        let cases = [
            (Error::InvalidRequest("x".into()), 400, "invalid_request"),
            (Error::Template("x".into()), 400, "invalid_request"),
            (Error::Unsupported("n".into()), 400, "unsupported"),
            (Error::ContextOverflow("x".into()), 400, "context_length_exceeded"),
            (Error::CacheFull("x".into()), 503, "kv_cache_full"),
            (Error::Tokenizer("x".into()), 500, "internal_error"),
            (Error::Device("x".into()), 500, "internal_error"),
        ];
        for (e, status, code) in cases {
            let message = e.to_string();
            let a = ApiError::from(e);
            assert_eq!((a.status.as_u16(), a.code), (status, code));
            let body = a.body();
            assert_eq!(body["error"]["message"], message);
            assert_eq!(body["error"]["code"], code);
            let kind = if status == 400 { "invalid_request_error" } else { "server_error" };
            assert_eq!(body["error"]["type"], kind);
        }
        assert_eq!(ApiError::loading().status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn server_sent_events() {
        assert_eq!(sse_bytes(Event::Chunk("{\"a\":1}".into())), Bytes::from("data: {\"a\":1}\n\n"));
        assert_eq!(sse_bytes(Event::Done(Ok(Value::Null))), Bytes::from("data: [DONE]\n\n"));
        let err = String::from_utf8(sse_bytes(Event::Done(Err(ApiError::internal("boom")))).to_vec()).unwrap();
        let (event, rest) = err.split_once("\n\n").unwrap();
        assert_eq!(rest, "data: [DONE]\n\n");
        let v: Value = serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(v["error"]["message"], "boom");
        assert_eq!(v["error"]["type"], "server_error");
    }

    fn server(api_key: Option<&str>) -> Server {
        Server {
            loaded: OnceLock::new(),
            api_key: api_key.map(str::to_string),
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            stream_timeout: Duration::from_secs(30),
        }
    }

    #[test]
    fn api_key_and_addresses() {
        let server = server(Some("k1"));
        let mut h = HeaderMap::new();
        assert_eq!(server.authorize(&h).unwrap_err().status, StatusCode::UNAUTHORIZED);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k2"));
        assert_eq!(server.authorize(&h).unwrap_err().status, StatusCode::UNAUTHORIZED);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k1"));
        assert!(server.authorize(&h).is_ok());
        assert!(self::server(None).authorize(&HeaderMap::new()).is_ok());
        assert!(server.ready().is_err());
        assert_eq!(format_addr("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(format_addr("::1", 80), "[::1]:80");
        assert_eq!(format_addr("[::1]", 80), "[::1]:80");
    }

    const STALL: Duration = Duration::from_millis(200);

    #[test]
    fn a_full_backlog_waits_for_a_slow_client_and_gives_up_on_a_stalled_one() {
        let backlog = Arc::new(Backlog::default());
        for _ in 0..STREAM_CHUNKS {
            backlog.admit(10, STALL).unwrap();
        }
        // Nothing taken: a stall.
        let start = Instant::now();
        assert_eq!(backlog.admit(10, STALL), Err(Gone::Stalled(STALL)));
        assert!(start.elapsed() >= STALL);

        // A client that takes one event every 3/4 of the timeout keeps the stream going, for
        // longer in all than the timeout.
        let reader = {
            let backlog = backlog.clone();
            std::thread::spawn(move || {
                for _ in 0..4 {
                    std::thread::sleep(STALL * 3 / 4);
                    backlog.taken(10);
                }
            })
        };
        let start = Instant::now();
        for _ in 0..4 {
            backlog.admit(10, STALL).unwrap();
        }
        assert!(start.elapsed() > STALL * 2);
        reader.join().unwrap();
    }

    #[test]
    fn the_backlog_is_bounded_by_bytes_and_a_lone_event_always_fits() {
        let backlog = Backlog::default();
        backlog.admit(STREAM_BYTES * 2, STALL).unwrap();
        assert_eq!(backlog.admit(1, STALL), Err(Gone::Stalled(STALL)));
        backlog.taken(STREAM_BYTES * 2);
        backlog.admit(STREAM_BYTES - 1, STALL).unwrap();
        backlog.admit(1, STALL).unwrap();
        assert_eq!(backlog.admit(1, STALL), Err(Gone::Stalled(STALL)));
    }

    #[test]
    fn a_client_that_leaves_frees_a_waiting_sender_at_once() {
        let backlog = Arc::new(Backlog::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let reader = BacklogReader { rx, backlog: backlog.clone() };
        let mut sender = ChunkSender { tx, backlog, stall: Duration::from_secs(60), gone: None };
        for _ in 0..STREAM_CHUNKS {
            sender.send(Event::Chunk("x".into())).unwrap();
        }
        let leave = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(reader);
        });
        let start = Instant::now();
        assert_eq!(sender.send(Event::Chunk("x".into())), Err(Gone::Left));
        assert!(start.elapsed() < Duration::from_secs(10));
        // Once gone, the end is not waited for.
        assert_eq!(sender.send(Event::Done(Ok(Value::Null))), Err(Gone::Left));
        leave.join().unwrap();
    }

    #[test]
    fn too_large_is_413() {
        let e = too_large(100);
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(e.message.contains("100 bytes"), "{}", e.message);
    }
}
