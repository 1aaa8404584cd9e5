/*
 * A plain C host for the Atlas C ABI: dlopens the library like Lemonade would and drives load,
 * chat, streaming, cancellation, bad options, bad requests, context overflow and unload.
 *
 *   cc -std=c11 -Wall -Wextra -I include tests/c/host.c -ldl -o host
 *   ./host target/release/libatlas.so tests/fixtures/models/chat_tiny [loops]
 *
 * Built with -fsanitize=address,undefined in CI; `loops` repeats load -> chat -> unload so leak
 * detection sees every allocation the library makes.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atlas.h"

static uint32_t (*p_abi_version)(void);
static const char *(*p_version)(void);
static int32_t (*p_load)(const char *, AtlasModel **, char **);
static void (*p_unload)(AtlasModel *);
static int32_t (*p_chat)(AtlasModel *, const char *, AtlasChunkCallback, void *, char **, char **);
static int32_t (*p_info)(AtlasModel *, char **, char **);
static void (*p_free)(char *);

static int failures = 0;
static int checks = 0;

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
    "\"temperature\":0,\"max_tokens\":24%s}";

static char *request(const char *extra) {
    static char buf[1024];
    snprintf(buf, sizeof buf, GREEDY, extra);
    return buf;
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

static AtlasModel *load(const char *dir) {
    char opts[1024];
    snprintf(opts, sizeof opts, "{\"model\":\"%s\",\"device\":\"cpu\",\"ctx_size\":256,\"threads\":2}", dir);
    AtlasModel *m = NULL;
    char *err = NULL;
    int32_t rc = p_load(opts, &m, &err);
    CHECK(rc == ATLAS_STATUS_OK && m != NULL, "load: %d %s", rc, err ? err : "");
    p_free(err);
    return m;
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
    CHECK(chat(m, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":3}", NULL, NULL) == ATLAS_STATUS_UNSUPPORTED, "n=3");
    CHECK(chat(m, "\xc3\x28", NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "invalid UTF-8");
    CHECK(chat(m, NULL, NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "NULL request");
    CHECK(p_chat(NULL, request(""), NULL, NULL, NULL, NULL) == ATLAS_STATUS_INVALID_ARGUMENT, "NULL model");
    CHECK(chat(m, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":100000}", NULL, NULL) ==
              ATLAS_STATUS_CONTEXT_OVERFLOW, "overflow");
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
    *(void **)&p_info = sym(lib, "atlas_model_info");
    *(void **)&p_free = sym(lib, "atlas_string_free");

    CHECK(p_abi_version() == ATLAS_ABI_VERSION, "abi %u", p_abi_version());
    CHECK(p_version() && strlen(p_version()) > 0, "version");
    p_unload(NULL);
    p_free(NULL);
    test_bad_options();
    for (int i = 0; i < loops; i++) {
        AtlasModel *m = load(argv[2]);
        if (m) test_model(m);
        p_unload(m);
    }
    printf("%d passed, %d failed\n", checks - failures, failures);
    return failures ? 1 : 0;
}
