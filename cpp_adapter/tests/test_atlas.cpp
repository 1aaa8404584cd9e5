// Tests atlas::Model against the fixture chat_tiny: a tiny random Qwen3 with a real tokenizer and
// chat template. Its answers are random text, so this checks plumbing (shapes, equality between
// runs, errors, cancellation, exceptions, ownership), never wording.
//
//   test_atlas MODEL_DIR [LIBRARY]     (LIBRARY is only reported: the executable links it)
#include "atlas/atlas.hpp"

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _WIN32
#ifndef NOMINMAX
#define NOMINMAX
#endif
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#include <shellapi.h>
#endif

namespace {

// The command-line arguments in UTF-8, which is what the library takes. On Windows main()'s argv
// is in the ANSI code page, which mangles a path outside it: the wide command line is converted.
std::vector<std::string> utf8_args(int argc, char** argv) {
#ifdef _WIN32
    int wargc = 0;
    if (wchar_t** wargv = CommandLineToArgvW(GetCommandLineW(), &wargc)) {
        std::vector<std::string> args;
        for (int i = 0; i < wargc; i++) {
            const int n = WideCharToMultiByte(CP_UTF8, 0, wargv[i], -1, nullptr, 0, nullptr, nullptr);
            std::string arg(n > 0 ? static_cast<std::size_t>(n) : 1, '\0');
            WideCharToMultiByte(CP_UTF8, 0, wargv[i], -1, &arg[0], n, nullptr, nullptr);
            arg.resize(arg.size() - 1);  // the terminating NUL
            args.push_back(arg);
        }
        LocalFree(wargv);
        if (wargc == argc) return args;
    }
#endif
    return std::vector<std::string>(argv, argv + argc);
}

int passed = 0;
int failed = 0;

void record(bool ok, int line, const char* what, const std::string& detail) {
    if (ok) {
        passed++;
        return;
    }
    failed++;
    std::fprintf(stderr, "FAIL test_atlas.cpp:%d: %s: %s\n", line, what, detail.c_str());
}

#define CHECK(cond, detail) record((cond), __LINE__, #cond, (detail))

bool contains(const std::string& haystack, const std::string& needle) {
    return haystack.find(needle) != std::string::npos;
}

// Runs f, which must throw atlas::Error with code `want` and a message containing `needle`.
template <class F>
void expect_error(int line, const char* what, AtlasStatus want, const std::string& needle, F&& f) {
    try {
        f();
        record(false, line, what, "no exception");
    } catch (const atlas::Error& e) {
        record(e.code() == want && contains(e.what(), needle), line, what,
               "wanted " + atlas::status_name(want) + " mentioning '" + needle + "', got " +
                   atlas::status_name(e.code()) + ": " + e.what());
    }
}

#define EXPECT_ERROR(want, needle, ...) expect_error(__LINE__, #__VA_ARGS__, want, needle, [&] { (void)(__VA_ARGS__); })

// --- Just enough JSON to take a top-level member's raw text out of a compact JSON object. ---

std::size_t skip_string(const std::string& s, std::size_t i) {  // s[i] is the opening quote
    for (std::size_t j = i + 1; j < s.size(); j++) {
        if (s[j] == '\\') j++;
        else if (s[j] == '"') return j + 1;
    }
    return s.size();
}

std::size_t skip_value(const std::string& s, std::size_t i) {
    int depth = 0;
    for (std::size_t j = i; j < s.size(); j++) {
        const char c = s[j];
        if (c == '"') {
            j = skip_string(s, j) - 1;
            if (depth == 0) return j + 1;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            if (depth == 0) return j;
            if (--depth == 0) return j + 1;
        } else if (c == ',' && depth == 0) {
            return j;
        }
    }
    return s.size();
}

// The raw JSON text of json[key], or "" when json is not an object holding key.
std::string member(const std::string& json, const std::string& key) {
    if (json.empty() || json[0] != '{') return "";
    std::size_t i = 1;
    while (i < json.size() && json[i] == '"') {
        const std::size_t key_end = skip_string(json, i);
        const std::string k = json.substr(i + 1, key_end - i - 2);
        if (key_end >= json.size() || json[key_end] != ':') return "";
        const std::size_t end = skip_value(json, key_end + 1);
        if (k == key) return json.substr(key_end + 1, end - key_end - 1);
        i = end < json.size() && json[end] == ',' ? end + 1 : json.size();
    }
    return "";
}

// A JSON string literal for s: model paths on Windows hold backslashes.
std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        out += c;
    }
    return out + "\"";
}

// --- The tests. ---

const std::string GREEDY = R"({"messages":[{"role":"user","content":"Hi"}],"temperature":0,"max_tokens":16)";
const std::string PLAIN = GREEDY + "}";
const std::string STREAMED = GREEDY + R"(,"stream":true})";

struct SinkFailure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

void test_library() {
    CHECK(atlas::abi_version() == ATLAS_ABI_VERSION, std::to_string(atlas::abi_version()));
    CHECK(!atlas::version().empty(), "empty version");
    CHECK(atlas::status_name(ATLAS_STATUS_CANCELLED) == "ATLAS_STATUS_CANCELLED", atlas::status_name(ATLAS_STATUS_CANCELLED));
}

void test_load_errors(const std::string& dir) {
    const std::string missing = dir + "/no-such-model";
    EXPECT_ERROR(ATLAS_STATUS_MODEL_LOAD, missing, atlas::Model(missing, "cpu"));
    EXPECT_ERROR(ATLAS_STATUS_MODEL_LOAD, missing, atlas::Model(R"({"model":)" + json_string(missing) + "}"));
    // Quotes and backslashes in the path must reach the library as a path, not break the JSON.
    EXPECT_ERROR(ATLAS_STATUS_MODEL_LOAD, "", atlas::Model(dir + "/a \"quoted\\\" dir\n", "cpu"));
    EXPECT_ERROR(ATLAS_STATUS_INVALID_ARGUMENT, "tpu", atlas::Model(dir, "tpu"));
    EXPECT_ERROR(ATLAS_STATUS_INVALID_ARGUMENT, "JSON", atlas::Model("{not json"));
    EXPECT_ERROR(ATLAS_STATUS_INVALID_ARGUMENT, "colour", atlas::Model(R"({"model":"x","colour":1})"));
}

void test_model(const atlas::Model& model) {
    const std::string info = model.info();
    CHECK(contains(info, R"("architecture":"qwen3")"), info);

    const std::string plain = model.chat(PLAIN);
    const std::string choices = member(plain, "choices");
    CHECK(member(plain, "object") == R"("chat.completion")", plain);
    CHECK(contains(choices, R"("role":"assistant")") && contains(choices, R"("finish_reason")"), plain);
    CHECK(member(model.chat(PLAIN), "choices") == choices, "greedy answers differ between runs");

    // Streaming: chunks flow, and the final response is the non-streamed one.
    std::vector<std::string> chunks;
    const std::string streamed = model.chat_stream(STREAMED, [&](const std::string& chunk) {
        chunks.push_back(chunk);
        return true;
    });
    CHECK(chunks.size() >= 3, std::to_string(chunks.size()) + " chunks");
    for (const std::string& chunk : chunks) {
        CHECK(member(chunk, "object") == R"("chat.completion.chunk")", chunk);
    }
    CHECK(member(streamed, "object") == R"("chat.completion")", streamed);
    CHECK(member(streamed, "choices") == choices, "streamed:\n" + streamed + "\nplain:\n" + plain);

    // Without "stream": true the sink is never called; chat() runs a streaming request to the end.
    int calls = 0;
    const std::string unstreamed = model.chat_stream(PLAIN, [&](const std::string&) { return ++calls > 0; });
    CHECK(calls == 0 && member(unstreamed, "choices") == choices, std::to_string(calls) + " calls");
    CHECK(member(model.chat(STREAMED), "choices") == choices, "chat() of a streaming request");
    CHECK(member(model.chat_stream(STREAMED, nullptr), "choices") == choices, "empty sink");

    // The sink cancels on its 2nd chunk.
    calls = 0;
    EXPECT_ERROR(ATLAS_STATUS_CANCELLED, "", model.chat_stream(STREAMED, [&](const std::string&) { return ++calls < 2; }));
    CHECK(calls == 2, std::to_string(calls) + " calls");

    // The sink's exception cancels and reaches the caller as itself, not as atlas::Error.
    calls = 0;
    try {
        model.chat_stream(STREAMED, [&](const std::string&) -> bool { calls++; throw SinkFailure("sink gave up"); });
        CHECK(false, "no exception");
    } catch (const SinkFailure& e) {
        CHECK(std::string(e.what()) == "sink gave up" && calls == 1, std::to_string(calls) + " calls");
    } catch (const atlas::Error& e) {
        CHECK(false, "atlas::Error instead of the sink's: " + std::string(e.what()));
    }
    try {  // not even a std::exception
        model.chat_stream(STREAMED, [](const std::string&) -> bool { throw 42; });
        CHECK(false, "no exception");
    } catch (int e) {
        CHECK(e == 42, std::to_string(e));
    }

    // Bad requests; the sink never sees them.
    EXPECT_ERROR(ATLAS_STATUS_INVALID_REQUEST, "", model.chat(R"({"messages":)"));
    EXPECT_ERROR(ATLAS_STATUS_INVALID_REQUEST, "", model.chat(R"({"messages":"hi"})"));
    calls = 0;
    EXPECT_ERROR(ATLAS_STATUS_INVALID_REQUEST, "", model.chat_stream(R"({"messages":"hi","stream":true})",
                                                                    [&](const std::string&) { return ++calls > 0; }));
    CHECK(calls == 0, std::to_string(calls) + " calls");

    // After cancellations, exceptions and errors the model answers exactly as before.
    CHECK(member(model.chat(PLAIN), "choices") == choices, "answer changed after errors");
}

void test_move(const std::string& dir) {
    static_assert(!std::is_copy_constructible<atlas::Model>::value && !std::is_copy_assignable<atlas::Model>::value,
                  "Model is move-only");
    static_assert(std::is_nothrow_move_constructible<atlas::Model>::value &&
                      std::is_nothrow_move_assignable<atlas::Model>::value,
                  "moving a Model never throws");

    atlas::Model a(dir, "cpu", 256);
    const std::string choices = member(a.chat(PLAIN), "choices");
    atlas::Model b(std::move(a));
    CHECK(!a && b, "move construction");
    CHECK(member(b.chat(PLAIN), "choices") == choices, "moved-to model answers differently");
    EXPECT_ERROR(ATLAS_STATUS_INVALID_ARGUMENT, "", a.chat(PLAIN));  // NOLINT(bugprone-use-after-move): on purpose
    EXPECT_ERROR(ATLAS_STATUS_INVALID_ARGUMENT, "", a.info());

    atlas::Model c(dir, "cpu", 256);
    c = std::move(b);  // unloads c's own model, takes b's
    CHECK(!b && c, "move assignment");
    CHECK(member(c.chat(PLAIN), "choices") == choices, "move-assigned model answers differently");
    a = std::move(c);  // into an empty one
    CHECK(a && !c && member(a.chat(PLAIN), "choices") == choices, "move back");
}

// Runs one group of checks; an exception it did not expect fails the group, not the program.
template <class F>
void run(const char* name, F&& f) {
    try {
        f();
    } catch (const atlas::Error& e) {
        failed++;
        std::fprintf(stderr, "FAIL %s: atlas::Error %s: %s\n", name, atlas::status_name(e.code()).c_str(), e.what());
    } catch (const std::exception& e) {
        failed++;
        std::fprintf(stderr, "FAIL %s: unexpected exception: %s\n", name, e.what());
    }
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL_DIR [LIBRARY]\n", argv[0]);
        return 2;
    }
    const std::vector<std::string> args = utf8_args(argc, argv);
    const std::string dir = args[1];
    std::printf("atlas %s (ABI %u)%s%s, model %s\n", atlas::version().c_str(), atlas::abi_version(),
                argc > 2 ? " from " : "", argc > 2 ? args[2].c_str() : "", dir.c_str());

    run("library", test_library);
    run("load errors", [&] { test_load_errors(dir); });
    run("model", [&] {
        const atlas::Model model(R"({"model":)" + json_string(dir) + R"(,"device":"cpu","ctx_size":256,"threads":2})");
        test_model(model);
    });
    run("move", [&] { test_move(dir); });

    std::printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
