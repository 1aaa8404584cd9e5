//! `atlas serve`: an OpenAI-compatible HTTP server over one loaded engine.
//!
//! The engine answers one request at a time: it sits behind a mutex and each completion runs on a
//! blocking thread, so requests queue in arrival order. Streamed chunks travel from that thread to
//! the client through a bounded channel; when the client goes away the channel closes, the chunk
//! callback returns false and generation stops at the next token. A non-streamed request whose
//! client goes away is cancelled the same way, through a flag set when its handler is dropped.

use std::convert::Infallible;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use atlas::api::{chat_completion, ChatRequest};
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
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use crate::LoadArgs;

/// Largest request body accepted.
const MAX_BODY: usize = 64 << 20;
/// Chunks buffered between the generating thread and a slow client before generation waits.
const STREAM_BUFFER: usize = 256;

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
}

struct Server {
    /// Set once the model has loaded; until then the API answers 503.
    loaded: OnceLock<Loaded>,
    api_key: Option<String>,
}

struct Loaded {
    engine: Mutex<Engine>,
    model: String,
    created: u64,
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
    let opts = args.load.options()?;
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

    let server = Arc::new(Server { loaded: OnceLock::new(), api_key: args.api_key.clone() });
    let (failed_tx, failed_rx) = oneshot::channel::<Error>();
    let loading = server.clone();
    tokio::task::spawn_blocking(move || match crate::load_engine(&opts) {
        Ok(engine) => {
            let model = engine.model_name();
            let loaded = Loaded { engine: Mutex::new(engine), model: model.clone(), created: unix_time() };
            let _ = loading.loaded.set(loaded);
            eprintln!("ready: model {model:?} at http://{local}/v1");
        }
        Err(e) => {
            let _ = failed_tx.send(e);
        }
    });

    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
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
        "no such endpoint (POST /v1/chat/completions, GET /v1/models, GET /health)",
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

/// Sets the flag when dropped: the handler of a non-streamed request was dropped (its client went
/// away) or finished.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

async fn chat_completions(
    State(server): State<Arc<Server>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    server.authorize(&headers)?;
    server.ready()?;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|n| n > MAX_BODY) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(body, MAX_BODY).await.map_err(|e| {
        if e.to_string().contains("length limit") {
            too_large()
        } else {
            ApiError::invalid(format!("could not read the request body: {e}"))
        }
    })?;
    let text =
        std::str::from_utf8(&bytes).map_err(|e| ApiError::invalid(format!("the request body is not UTF-8: {e}")))?;
    let mut request = ChatRequest::from_json_str(text).map_err(|e| {
        eprintln!("rejected a request: {e}");
        ApiError::from(e)
    })?;
    let streaming = request.stream;
    // Chunks always flow through the callback, so that a vanished client cancels either way.
    request.stream = true;
    if streaming {
        stream_completion(server, request).await
    } else {
        let cancelled = Arc::new(AtomicBool::new(false));
        let _guard = CancelOnDrop(cancelled.clone());
        let job = tokio::task::spawn_blocking(move || {
            let wanted = || !cancelled.load(Ordering::Relaxed);
            run_completion(&server, &request, &wanted, &mut |_| wanted())
        });
        let answer = job.await.map_err(|e| ApiError::internal(format!("the request failed: {e}")))??;
        Ok(json_response(StatusCode::OK, &answer))
    }
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        "request_too_large",
        format!("the request body is larger than {} MiB", MAX_BODY >> 20),
    )
}

/// Waits for the engine, then runs one completion on the calling (blocking) thread.
/// `wanted` says whether the client is still there.
fn run_completion(
    server: &Server,
    request: &ChatRequest,
    wanted: &dyn Fn() -> bool,
    on_chunk: &mut dyn FnMut(&str) -> bool,
) -> Result<Value, ApiError> {
    let loaded = server.ready()?;
    let mut engine = loaded.engine.lock().unwrap_or_else(|poisoned| {
        loaded.engine.clear_poison();
        let mut engine = poisoned.into_inner();
        engine.reset_cache();
        engine
    });
    // A request whose client left while it waited in the queue is not run.
    if !wanted() {
        return Err(Error::Cancelled.into());
    }
    let start = Instant::now();
    let result = catch_unwind(AssertUnwindSafe(|| chat_completion(&mut engine, request, &mut *on_chunk)));
    let ms = start.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(Ok(answer)) => {
            let usage = &answer["usage"];
            eprintln!(
                "chat completion: {} prompt tokens ({} cached), {} generated, finish {}, {ms:.0} ms",
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
                usage["completion_tokens"],
                answer["choices"][0]["finish_reason"],
            );
            Ok(answer)
        }
        Ok(Err(Error::Cancelled)) => {
            eprintln!("chat completion cancelled after {ms:.0} ms: the client went away");
            Err(Error::Cancelled.into())
        }
        Ok(Err(e)) => {
            eprintln!("chat completion failed: {e}");
            Err(e.into())
        }
        Err(panic) => {
            engine.reset_cache();
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            eprintln!("chat completion panicked: {what}");
            Err(ApiError::internal(format!("internal error: {what}")))
        }
    }
}

/// Server-sent events: `data: {chunk}` per chunk, then `data: [DONE]`. The response waits for the
/// generation's second event (its first delta after the role chunk) or its end, so that errors
/// found before any token (a bad conversation, a prompt over the context) still get an HTTP status.
async fn stream_completion(server: Arc<Server>, request: ChatRequest) -> Result<Response, ApiError> {
    let (tx, mut rx) = mpsc::channel::<Event>(STREAM_BUFFER);
    tokio::task::spawn_blocking(move || {
        let wanted = || !tx.is_closed();
        let mut on_chunk = |chunk: &str| tx.blocking_send(Event::Chunk(chunk.to_string())).is_ok();
        let result = run_completion(&server, &request, &wanted, &mut on_chunk);
        let _ = tx.blocking_send(Event::Done(result));
    });

    let mut head = Vec::new();
    loop {
        match rx.recv().await {
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
    let events = tokio_stream::iter(head).chain(ReceiverStream::new(rx));
    let body = Body::from_stream(events.map(|event| Ok::<Bytes, Infallible>(sse_bytes(event))));
    let mut response = Response::new(body);
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
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

    #[test]
    fn api_key_and_addresses() {
        let server = Server { loaded: OnceLock::new(), api_key: Some("k1".into()) };
        let mut h = HeaderMap::new();
        assert_eq!(server.authorize(&h).unwrap_err().status, StatusCode::UNAUTHORIZED);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k2"));
        assert_eq!(server.authorize(&h).unwrap_err().status, StatusCode::UNAUTHORIZED);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k1"));
        assert!(server.authorize(&h).is_ok());
        assert!(Server { loaded: OnceLock::new(), api_key: None }.authorize(&HeaderMap::new()).is_ok());
        assert!(server.ready().is_err());
        assert_eq!(format_addr("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(format_addr("::1", 80), "[::1]:80");
        assert_eq!(format_addr("[::1]", 80), "[::1]:80");
    }
}
