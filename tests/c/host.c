/*
 * A plain C host for the Atlas C ABI: dlopens the library like Lemonade would and drives load,
 * chat, streaming, cancellation, bad options, bad requests, context overflow, limits, unload
 * racing requests, arrival order, re-entrant calls from a callback, and stale handles.
 *
 *   cc -std=c11 -Wall -Wextra -I include tests/c/host.c -ldl -pthread -o host
 *   ./host target/release/libatlas.so tests/fixtures/models/chat_tiny [loops]
 *
 * Built with -fsanitize=address,undefined in CI; `loops` repeats every test (the unload race
 * many times per loop) so the sanitizers and leak detection see every path the library takes.
 * A deadlock ends the run through alarm() (on Windows, a watchdog thread).
 *
 * Windows (scripts/test_windows.sh, under Wine): LoadLibrary/GetProcAddress stand in for
 * dlopen/dlsym, and pthreads come from mingw-w64's winpthreads:
 *   x86_64-w64-mingw32-gcc -std=c11 -Wall -Wextra -I include tests/c/host.c -pthread -o host.exe
 *   host.exe atlas.dll tests/fixtures/models/chat_tiny
 */
#define _DEFAULT_SOURCE
#ifdef _WIN32
#include <windows.h>
#else
#include <dlfcn.h>
#endif
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "atlas.h"

#ifdef _WIN32
#define RTLD_NOW 0
#define RTLD_LOCAL 0
static void *dlopen(const char *path, int flags) {
    (void)flags;
    return (void *)LoadLibraryA(path);
}
static void *dlsym(void *lib, const char *name) {
    return (void *)GetProcAddress((HMODULE)lib, name);
}
static const char *dlerror(void) {
    static char message[64];
    snprintf(message, sizeof message, "LoadLibrary failed, error %lu", (unsigned long)GetLastError());
    return message;
}
#endif

static uint32_t (*p_abi_version)(void);
static const char *(*p_version)(void);
static int32_t (*p_load)(const char *, AtlasModel **, char **);
static void (*p_unload)(AtlasModel *);
static int32_t (*p_chat)(AtlasModel *, const char *, AtlasChunkCallback, void *, char **, char **);
static int32_t (*p_text)(AtlasModel *, const char *, AtlasChunkCallback, void *, char **, char **);
static int32_t (*p_info)(AtlasModel *, char **, char **);
static void (*p_free)(char *);

static atomic_int failures = 0;
static atomic_int checks = 0;

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        checks++;                                                           \
        if (!(cond)) {                                                      \
            failures++;                                                     \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                   \
            fprintf(stderr, "\n");                                          \
        }                                                                   \
    } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "missing symbol %s\n", name);
        exit(2);
    }
    return p;
}

struct stream_state {
    int chunks;
    int cancel_after; /* 0: never cancel */
    size_t bytes;
    int bad_chunks;
};

static int32_t on_chunk(const char *chunk, void *user_data) {
    struct stream_state *s = user_data;
    s->chunks++;
    s->bytes += strlen(chunk);
    if (!strstr(chunk, "\"object\":\"chat.completion.chunk\"")) s->bad_chunks++;
    return s->cancel_after && s->chunks >= s->cancel_after;
}

/* Runs one request; returns the status and frees everything. */
static int32_t chat(AtlasModel *m, const char *req, struct stream_state *s, char **response) {
    char *err = NULL, *resp = NULL;
    int32_t rc = p_chat(m, req, s ? on_chunk : NULL, s, &resp, &err);
    if (rc == ATLAS_STATUS_OK) {
        CHECK(resp != NULL && err == NULL, "ok without response");
    } else {
        CHECK(resp == NULL && err != NULL && strlen(err) > 0, "error %d without message", rc);
    }
    if (response) *response = resp; else p_free(resp);
    p_free(err);
    return rc;
}

static const char *GREEDY =
    "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hello, caf\xc3\xa9!\"}],"
    "\"temperature\":0,\"max_tokens\":%d%s}";

static char *request_tokens(int max_tokens, const char *extra) {
    static _Thread_local char buf[1024];
    snprintf(buf, sizeof buf, GREEDY, max_tokens, extra);
    return buf;
}

static char *request(const char *extra) {
    return request_tokens(24, extra);
}

static void test_bad_options(void) {
    AtlasModel *m = (AtlasModel *)0x1;
    char *err = NULL;
    CHECK(p_load(NULL, &m, &err) == ATLAS_STATUS_INVALID_ARGUMENT && m == NULL, "NULL options");
    p_free(err);
    CHECK(p_load("{}", NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "NULL out_model");
    struct { const char *json; int32_t want; const char *needle; } cases[] = {
        {"{not json", ATLAS_STATUS_INVALID_ARGUMENT, "JSON"},
        {"{\"model\":\"x\",\"colour\":1}", ATLAS_STATUS_INVALID_ARGUMENT, "colour"},
        {"{\"device\":\"cpu\"}", ATLAS_STATUS_INVALID_ARGUMENT, "model"},
        {"{\"model\":\"/nonexistent/atlas\"}", ATLAS_STATUS_MODEL_LOAD, "/nonexistent/atlas"},
        {"{\"model\":\"x\",\"ctx_size\":-4}", ATLAS_STATUS_INVALID_ARGUMENT, "ctx_size"},
        {"{\"model\":\"x\",\"device\":\"tpu\"}", ATLAS_STATUS_INVALID_ARGUMENT, "tpu"},
        {"\xff\xfe", ATLAS_STATUS_INVALID_ARGUMENT, "UTF-8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        err = NULL;
        int32_t rc = p_load(cases[i].json, &m, &err);
        CHECK(rc == cases[i].want && m == NULL, "options %s: status %d", cases[i].json, rc);
        CHECK(err && strstr(err, cases[i].needle), "options %s: message %s", cases[i].json, err ? err : "(null)");
        p_free(err);
    }
}

static AtlasModel *load_with(const char *dir, const char *extra) {
    char opts[1024];
    snprintf(opts, sizeof opts, "{\"model\":\"%s\",\"device\":\"cpu\",\"ctx_size\":256,\"threads\":2%s}", dir, extra);
    AtlasModel *m = NULL;
    char *err = NULL;
    int32_t rc = p_load(opts, &m, &err);
    CHECK(rc == ATLAS_STATUS_OK && m != NULL, "load: %d %s", rc, err ? err : "");
    p_free(err);
    return m;
}

static AtlasModel *load(const char *dir) {
    return load_with(dir, "");
}

static void test_model(AtlasModel *m) {
    char *info = NULL, *err = NULL;
    CHECK(p_info(m, &info, &err) == ATLAS_STATUS_OK && strstr(info, "\"architecture\":\"qwen3\""), "info %s", info);
    p_free(info);
    p_free(err);

    char *plain = NULL, *again = NULL, *streamed = NULL;
    CHECK(chat(m, request(""), NULL, &plain) == ATLAS_STATUS_OK, "plain chat");
    CHECK(plain && strstr(plain, "\"object\":\"chat.completion\"") && strstr(plain, "\"finish_reason\":\"length\""), "%s", plain);
    CHECK(plain && strstr(plain, "\"usage\"") && strstr(plain, "\"timings\""), "usage/timings");

    struct stream_state s = {0};
    const char *stream_req = request(",\"stream\":true,\"stream_options\":{\"include_usage\":true}");
    CHECK(chat(m, stream_req, &s, &streamed) == ATLAS_STATUS_OK, "stream chat");
    CHECK(s.chunks >= 3 && s.bad_chunks == 0, "chunks %d bad %d", s.chunks, s.bad_chunks);

    struct stream_state c = {.cancel_after = 2};
    CHECK(chat(m, stream_req, &c, NULL) == ATLAS_STATUS_CANCELLED && c.chunks == 2, "cancel: %d chunks", c.chunks);

    /* After a cancel and after errors the model answers exactly as before. */
    CHECK(chat(m, "{\"messages\":", NULL, NULL) == ATLAS_STATUS_INVALID_REQUEST, "malformed JSON");
    CHECK(chat(m, "{\"messages\":\"hi\"}", NULL, NULL) == ATLAS_STATUS_INVALID_REQUEST, "wrong type");
    CHECK(chat(m, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"modalities\":[\"audio\"]}", NULL, NULL) ==
              ATLAS_STATUS_UNSUPPORTED, "audio output");
    CHECK(chat(m, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":17}", NULL, NULL) == ATLAS_STATUS_INVALID_REQUEST, "n=17");
    CHECK(chat(m, "\xc3\x28", NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "invalid UTF-8");
    CHECK(chat(m, NULL, NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "NULL request");
    CHECK(p_chat(NULL, request(""), NULL, NULL, NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "NULL model");
    CHECK(chat(m, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":100000}", NULL, NULL) ==
              ATLAS_STATUS_CONTEXT_OVERFLOW, "overflow");
    /* A sum that wraps in 64 bits must not pass the context check. */
    CHECK(chat(m, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":18446744073709551615}", NULL, NULL) ==
              ATLAS_STATUS_CONTEXT_OVERFLOW, "max_tokens 2^64-1");
    CHECK(chat(m, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":{\"messages\":1}}", NULL, NULL) ==
              ATLAS_STATUS_INVALID_REQUEST, "kwarg clash");
    CHECK(chat(m, request(""), NULL, &again) == ATLAS_STATUS_OK, "chat again");

    /* Same greedy answer every time (ids and timings differ, the message must not). */
    const char *a = plain ? strstr(plain, "\"choices\"") : NULL, *b = again ? strstr(again, "\"choices\"") : NULL;
    const char *ae = a ? strstr(a, "\"usage\"") : NULL, *be = b ? strstr(b, "\"usage\"") : NULL;
    CHECK(a && b && ae && be && (ae - a) == (be - b) && memcmp(a, b, (size_t)(ae - a)) == 0, "answers differ");
    const char *sc = streamed ? strstr(streamed, "\"choices\"") : NULL;
    const char *se = sc ? strstr(sc, "\"usage\"") : NULL;
    CHECK(a && sc && se && (se - sc) == (ae - a) && memcmp(a, sc, (size_t)(ae - a)) == 0, "stream answer differs");
    p_free(plain);
    p_free(again);
    p_free(streamed);

    /* Text completions: the same calling convention, text_completion objects. */
    char *text = NULL;
    err = NULL;
    CHECK(p_text(m, "{\"prompt\":\"The sea\",\"max_tokens\":4,\"temperature\":0,\"echo\":true}", NULL, NULL, &text, &err) ==
              ATLAS_STATUS_OK && text && strstr(text, "\"object\":\"text_completion\"") && strstr(text, "\"text\":\"The sea"),
          "text completion %s %s", text ? text : "", err ? err : "");
    p_free(text);
    p_free(err);
    err = NULL;
    CHECK(p_text(m, "{\"messages\":[]}", NULL, NULL, &text, &err) == ATLAS_STATUS_INVALID_REQUEST && err, "chat fields refused");
    p_free(err);
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "FAIL: still blocked after 120 s (deadlock)\n";
    (void)!write(2, msg, sizeof msg - 1);
    _exit(124);
}

#ifdef _WIN32
static void *watchdog(void *arg) {
    (void)arg;
    Sleep(120 * 1000);
    on_alarm(0);
    return NULL;
}
static void start_watchdog(void) {
    pthread_t t;
    pthread_create(&t, NULL, watchdog, NULL);
    pthread_detach(t);
}
#else
static void start_watchdog(void) {
    signal(SIGALRM, on_alarm);
    alarm(120);
}
#endif

/* Oversized input is refused before it costs anything, and the model stays usable. */
static void test_limits(const char *dir) {
    AtlasModel *m = load_with(dir, ",\"max_request_bytes\":65536");
    if (!m) return;
    size_t n = 1 << 20;
    char *big = malloc(n + 128);
    int o = sprintf(big, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    memset(big + o, 'a', n);
    strcpy(big + o + n, "\"}]}");
    char *err = NULL, *resp = NULL;
    CHECK(p_chat(m, big, NULL, NULL, &resp, &err) == ATLAS_STATUS_INVALID_REQUEST && err && strstr(err, "max_request_bytes"),
          "1 MiB request over a 64 KiB limit: %s", err ? err : "(null)");
    p_free(err);
    p_unload(m);

    /* Under the default limit, a message far longer than the context fails from its length. */
    m = load(dir);
    if (!m) { free(big); return; }
    err = NULL;
    CHECK(p_chat(m, big, NULL, NULL, &resp, &err) == ATLAS_STATUS_CONTEXT_OVERFLOW && err && strstr(err, "at least"),
          "1 MiB message: %s", err ? err : "(null)");
    p_free(err);
    free(big);

    /* Many stop strings would be matched against every token: bounded. */
    char *stops = malloc(200000 * 8 + 256);
    o = sprintf(stops, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":[");
    for (int i = 0; i < 200000; i++) o += sprintf(stops + o, "%s\"s%d\"", i ? "," : "", i % 1000);
    strcpy(stops + o, "]}");
    CHECK(chat(m, stops, NULL, NULL) == ATLAS_STATUS_INVALID_REQUEST, "200000 stop strings");
    free(stops);
    CHECK(chat(m, request(""), NULL, NULL) == ATLAS_STATUS_OK, "usable after refusals");
    p_unload(m);
}

/* Unload while another thread's request is running or queued: the request finishes or fails
   cleanly, never touches freed memory (ASan), and later calls with the handle fail. */
static AtlasModel *race_model;
static atomic_int race_entered;

static void *race_request(void *arg) {
    (void)arg;
    atomic_store(&race_entered, 1);
    int32_t rc = chat(race_model, request(""), NULL, NULL);
    CHECK(rc == ATLAS_STATUS_OK || rc == ATLAS_STATUS_INVALID_ARGUMENT, "raced request: status %d", rc);
    return NULL;
}

static void test_unload_race(const char *dir, int rounds) {
    for (int i = 0; i < rounds; i++) {
        race_model = load(dir);
        if (!race_model) return;
        atomic_store(&race_entered, 0);
        pthread_t t;
        pthread_create(&t, NULL, race_request, NULL);
        while (!atomic_load(&race_entered)) usleep(10);
        usleep((useconds_t)(i % 7) * 300);
        p_unload(race_model);
        pthread_join(t, NULL);
        char *err = NULL, *info = NULL;
        CHECK(p_info(race_model, &info, &err) == ATLAS_STATUS_INVALID_ARGUMENT && info == NULL && err && strstr(err, "not loaded"),
              "stale handle: %s", err ? err : "(null)");
        p_free(err);
        CHECK(chat(race_model, request(""), NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "chat on a stale handle");
    }
}

/* Requests use the model in arrival order: B arrives while A's first request runs, so B is
   served before A's second request, which arrives after A's first returns. A2 asks for many more
   tokens than B: B, served first, has returned before A2 ends even when its thread is slow to
   return after letting the engine go (A2 of the same length could end first: 1 run in 10). */
static AtlasModel *fifo_model;
static atomic_int fifo_order, b_done_at, a2_done_at;

static void *fifo_b(void *arg) {
    (void)arg;
    CHECK(chat(fifo_model, request(""), NULL, NULL) == ATLAS_STATUS_OK, "B");
    atomic_store(&b_done_at, atomic_fetch_add(&fifo_order, 1) + 1);
    return NULL;
}

static pthread_t fifo_thread;
static int32_t start_b_then_wait(const char *chunk, void *user_data) {
    (void)chunk;
    int *started = user_data;
    if (!*started) {
        *started = 1;
        pthread_create(&fifo_thread, NULL, fifo_b, NULL);
        usleep(200000); /* B enters and takes its place in the queue meanwhile */
    }
    return 0;
}

static void test_arrival_order(const char *dir) {
    fifo_model = load(dir);
    if (!fifo_model) return;
    atomic_store(&fifo_order, 0);
    int started = 0;
    char *resp = NULL, *err = NULL;
    CHECK(p_chat(fifo_model, request(",\"stream\":true"), start_b_then_wait, &started, &resp, &err) == ATLAS_STATUS_OK, "A1");
    p_free(resp);
    p_free(err);
    CHECK(chat(fifo_model, request_tokens(200, ""), NULL, NULL) == ATLAS_STATUS_OK, "A2");
    atomic_store(&a2_done_at, atomic_fetch_add(&fifo_order, 1) + 1);
    if (started) pthread_join(fifo_thread, NULL);
    CHECK(atomic_load(&b_done_at) == 1 && atomic_load(&a2_done_at) == 2, "B finished #%d, A2 #%d", atomic_load(&b_done_at),
          atomic_load(&a2_done_at));
    p_unload(fifo_model);
}

/* Calls back into the same model from inside on_chunk: info answers, a nested request fails at
   once instead of deadlocking, and unload is deferred until the outer request returns. */
struct reentry { AtlasModel *m; int mode; int calls; int32_t nested_rc; };

static int32_t reenter(const char *chunk, void *user_data) {
    (void)chunk;
    struct reentry *r = user_data;
    if (r->calls++ > 0) return 0;
    char *out = NULL, *err = NULL;
    if (r->mode == 0) {
        r->nested_rc = p_chat(r->m, request(""), NULL, NULL, &out, &err);
    } else if (r->mode == 1) {
        r->nested_rc = p_info(r->m, &out, &err);
    } else {
        p_unload(r->m);
        r->nested_rc = p_info(r->m, &out, &err);
    }
    p_free(out);
    p_free(err);
    return 0;
}

static void test_reentrancy(const char *dir) {
    const int32_t want_nested[3] = {ATLAS_STATUS_INVALID_ARGUMENT, ATLAS_STATUS_OK, ATLAS_STATUS_INVALID_ARGUMENT};
    for (int mode = 0; mode < 3; mode++) {
        struct reentry r = {.m = load(dir), .mode = mode};
        if (!r.m) return;
        char *resp = NULL, *err = NULL;
        int32_t rc = p_chat(r.m, request(",\"stream\":true"), reenter, &r, &resp, &err);
        CHECK(rc == ATLAS_STATUS_OK, "mode %d: outer request %d %s", mode, rc, err ? err : "");
        CHECK(r.nested_rc == want_nested[mode], "mode %d: nested call returned %d", mode, r.nested_rc);
        p_free(resp);
        p_free(err);
        if (mode == 2) {
            CHECK(chat(r.m, request(""), NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "after a deferred unload");
        } else {
            CHECK(chat(r.m, request(""), NULL, NULL) == ATLAS_STATUS_OK, "mode %d: usable afterwards", mode);
            p_unload(r.m);
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s LIBATLAS MODEL_DIR [LOOPS]\n", argv[0]);
        return 2;
    }
    int loops = argc > 3 ? atoi(argv[3]) : 1;
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    *(void **)&p_abi_version = sym(lib, "atlas_abi_version");
    *(void **)&p_version = sym(lib, "atlas_version");
    *(void **)&p_load = sym(lib, "atlas_load");
    *(void **)&p_unload = sym(lib, "atlas_unload");
    *(void **)&p_chat = sym(lib, "atlas_chat_completion");
    *(void **)&p_text = sym(lib, "atlas_text_completion");
    *(void **)&p_info = sym(lib, "atlas_model_info");
    *(void **)&p_free = sym(lib, "atlas_string_free");

    CHECK(p_abi_version() == ATLAS_ABI_VERSION, "abi %u", p_abi_version());
    CHECK(p_version() && strlen(p_version()) > 0, "version");
    p_unload(NULL);
    p_free(NULL);
    test_bad_options();
    start_watchdog();
    for (int i = 0; i < loops; i++) {
        AtlasModel *m = load(argv[2]);
        if (m) test_model(m);
        p_unload(m);
        test_limits(argv[2]);
        test_unload_race(argv[2], 20);
        test_arrival_order(argv[2]);
        test_reentrancy(argv[2]);
    }
    printf("%d passed, %d failed\n", checks - failures, failures);
    return failures ? 1 : 0;
}
