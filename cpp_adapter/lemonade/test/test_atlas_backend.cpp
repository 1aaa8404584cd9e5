// Tests the Atlas backend of Lemonade (AtlasServer, its descriptor and ops) inside a Lemonade build,
// against a real libatlas and a real model. It belongs at test/cpp/test_atlas_backend.cpp of a
// Lemonade tree, linked with lemonade-server-core (docs/lemonade.md shows the CMake lines).
//
//   test_atlas_backend MODEL_DIR [GGUF_FILE]
//
// MODEL_DIR: a chat model directory; the Atlas repository's tests/fixtures/models/chat_tiny (a tiny
// random Qwen3 with a real tokenizer and chat template) is enough: its answers are random text, so
// this checks plumbing, never wording. GGUF_FILE (optional): a .gguf chat model, loaded and asked once.
#include "lemon/backends/atlas/atlas.h"
#include "lemon/backends/atlas/atlas_server.h"
#include "lemon/backends/backend_registry.h"

#include <atlas.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

using lemon::json;
using lemon::ModelInfo;
using lemon::ModelType;
using lemon::RecipeOptions;
using lemon::StreamingProxy;
using lemon::backends::AtlasServer;

namespace {

int passed = 0;
int failed = 0;

void record(bool ok, int line, const char* what, const std::string& detail) {
    if (ok) {
        passed++;
        return;
    }
    failed++;
    std::fprintf(stderr, "FAIL test_atlas_backend.cpp:%d: %s: %s\n", line, what, detail.c_str());
}

#define CHECK(cond, detail) record((cond), __LINE__, #cond, (detail))

// Runs f, which must throw E with a message containing needle.
template <class E, class F>
void expect_throw(int line, const char* what, const std::string& needle, F&& f) {
    try {
        f();
        record(false, line, what, "no exception");
    } catch (const E& e) {
        record(std::string(e.what()).find(needle) != std::string::npos, line, what,
               std::string("message: ") + e.what());
    } catch (const std::exception& e) {
        record(false, line, what, std::string("other exception: ") + e.what());
    }
}

#define EXPECT_THROW(E, needle, ...) expect_throw<E>(__LINE__, #__VA_ARGS__, needle, [&] { (void)(__VA_ARGS__); })

bool contains(const std::string& haystack, const std::string& needle) {
    return haystack.find(needle) != std::string::npos;
}

std::string error_code(const json& response) {
    if (!response.is_object() || !response.contains("error") || !response["error"].is_object()) return "";
    return response["error"].value("code", std::string(response["error"].value("type", std::string())));
}

json user_request(const std::string& text, int max_tokens) {
    return json{{"model", "chat-tiny"},
                {"messages", json::array({json{{"role", "user"}, {"content", text}}})},
                {"max_tokens", max_tokens},
                {"temperature", 0},
                {"seed", 7}};
}

// A sink that records what is written; write_limit frames accepted, then the "client" is gone.
struct FakeClient {
    httplib::DataSink sink;
    std::string bytes;
    int writes = 0;
    int write_limit = -1;
    bool done = false;

    FakeClient() {
        sink.write = [this](const char* data, size_t n) {
            if (write_limit >= 0 && writes >= write_limit) return false;
            writes++;
            bytes.append(data, n);
            return true;
        };
        sink.is_writable = [] { return true; };
        sink.done = [this] { done = true; };
    }

    // The SSE events' payloads, in order.
    std::vector<std::string> events() const {
        std::vector<std::string> out;
        std::size_t pos = 0;
        while (pos < bytes.size()) {
            const std::size_t end = bytes.find("\n\n", pos);
            if (end == std::string::npos) {
                out.push_back("<unterminated>" + bytes.substr(pos));
                break;
            }
            const std::string event = bytes.substr(pos, end - pos);
            out.push_back(event.rfind("data: ", 0) == 0 ? event.substr(6) : "<not data>" + event);
            pos = end + 2;
        }
        return out;
    }
};

// Content of a streamed answer: the concatenated delta.content of its chunks.
std::string streamed_content(const std::vector<std::string>& events) {
    std::string content;
    for (const auto& e : events) {
        if (e == "[DONE]") continue;
        const json chunk = json::parse(e, nullptr, false);
        if (!chunk.is_object() || !chunk.contains("choices")) continue;
        for (const auto& choice : chunk["choices"]) {
            if (choice.contains("delta") && choice["delta"].contains("content") &&
                choice["delta"]["content"].is_string()) {
                content += choice["delta"]["content"].get<std::string>();
            }
        }
    }
    return content;
}

std::string message_content(const json& response) {
    try {
        const json& c = response.at("choices").at(0).at("message").at("content");
        return c.is_string() ? c.get<std::string>() : "";
    } catch (const std::exception&) {
        return "<no content>";
    }
}

ModelInfo model_info(const std::string& name, const std::string& path) {
    ModelInfo info;
    info.model_name = name;
    info.recipe = "atlas";
    info.checkpoints["main"] = path;
    info.resolved_paths["main"] = path;
    info.type = ModelType::LLM;
    return info;
}

void test_building_blocks(const std::string& model_dir) {
    CHECK(AtlasServer::device_for_backend("rocm") == "hip", "rocm");
    CHECK(AtlasServer::device_for_backend("cuda") == "cuda", "cuda");
    CHECK(AtlasServer::device_for_backend("cpu") == "cpu", "cpu");
    CHECK(AtlasServer::device_for_backend("auto") == "auto", "auto");
    CHECK(AtlasServer::device_for_backend("") == "auto", "empty");
    EXPECT_THROW(std::invalid_argument, "vulkan", AtlasServer::device_for_backend("vulkan"));

    const json args = AtlasServer::parse_atlas_args("--threads 2 --seed=7");
    CHECK(args == json({{"threads", 2}, {"seed", 7}}), args.dump());
    CHECK(AtlasServer::parse_atlas_args("").empty(), "no args");
    EXPECT_THROW(std::invalid_argument, "ctx_size", AtlasServer::parse_atlas_args("--ctx-size 4096"));
    EXPECT_THROW(std::invalid_argument, "--atlas", AtlasServer::parse_atlas_args("--device hip"));
    EXPECT_THROW(std::invalid_argument, "--bogus", AtlasServer::parse_atlas_args("--bogus 1"));
    EXPECT_THROW(std::invalid_argument, "whole number", AtlasServer::parse_atlas_args("--threads two"));
    EXPECT_THROW(std::invalid_argument, "whole number", AtlasServer::parse_atlas_args("--threads 0"));
    EXPECT_THROW(std::invalid_argument, "needs a value", AtlasServer::parse_atlas_args("--seed"));

    const RecipeOptions explicit_cpu("atlas", {{"atlas_backend", "cpu"}, {"ctx_size", 256}, {"atlas_args", "--threads 2"}});
    const json load = AtlasServer::load_options_for(model_dir, explicit_cpu);
    CHECK(load == json({{"model", model_dir}, {"device", "cpu"}, {"ctx_size", 256}, {"threads", 2}}), load.dump());
    const RecipeOptions automatic("atlas", {{"atlas_backend", "auto"}, {"ctx_size", -1}});
    const json auto_load = AtlasServer::load_options_for(model_dir, automatic);
    CHECK(auto_load == json({{"model", model_dir}, {"device", "auto"}}), auto_load.dump());
    CHECK(AtlasServer::load_options_for(model_dir, RecipeOptions("atlas", {{"atlas_backend", "rocm"}}))["device"] == "hip",
          "rocm -> hip");

    json request = user_request("hi", 4);
    request["ctx_size"] = 4096;
    request["atlas_backend"] = "cpu";
    request["cache_prompt"] = true;
    const json clean = AtlasServer::sanitize_request(request);
    CHECK(!clean.contains("ctx_size") && !clean.contains("atlas_backend") && !clean.contains("cache_prompt"), clean.dump());
    CHECK(clean["messages"] == request["messages"] && clean["max_tokens"] == 4, clean.dump());
    request["cache_prompt"] = false;
    CHECK(AtlasServer::sanitize_request(request).contains("cache_prompt"), "cache_prompt false is left to Atlas");

    const json overflow = AtlasServer::error_response(ATLAS_STATUS_CONTEXT_OVERFLOW, "too long");
    CHECK(overflow["error"]["status_code"] == 400 && overflow["error"]["code"] == "context_length_exceeded" &&
              overflow["error"]["message"] == "too long" && overflow["error"]["atlas_status"] == "ATLAS_STATUS_CONTEXT_OVERFLOW",
          overflow.dump());
    CHECK(AtlasServer::error_response(ATLAS_STATUS_UNSUPPORTED, "x")["error"]["type"] == "unsupported_operation", "unsupported");
    CHECK(AtlasServer::error_response(ATLAS_STATUS_CANCELLED, "x")["error"]["status_code"] == 499, "cancelled");
    CHECK(AtlasServer::error_response(ATLAS_STATUS_DEVICE, "x")["error"]["status_code"] == 500, "device");
    CHECK(AtlasServer::error_response(ATLAS_STATUS_CACHE_FULL, "x")["error"]["status_code"] == 503, "cache full");
}

void test_descriptor_and_registry() {
    const auto& d = lemon::backends::atlas::descriptor;
    CHECK(d.recipe == "atlas" && d.display_name == "Atlas" && d.binary.empty(), d.recipe);
    CHECK(d.default_device == lemon::DEVICE_GPU && d.slot_policy == lemon::SlotPolicy::Standard, "device/slots");
    CHECK(d.selectable_backend && d.uses_ctx_size && d.takes_args, "options");
    CHECK(d.supported_modes == std::vector<std::string>{"chat"}, "modes");
    bool flag = false;
    for (const auto& o : d.options) flag = flag || (o.name == "atlas_backend" && o.cli_flag == "--atlas");
    CHECK(flag, "--atlas flag");
    std::vector<std::string> rows;
    for (const auto& s : d.support) rows.push_back(s.backend);
    CHECK((rows == std::vector<std::string>{"rocm", "cuda", "cpu"}), "support rows");
    CHECK(d.config_defaults() == json({{"backend", "auto"}, {"args", ""}}), d.config_defaults().dump());
    CHECK(lemon::backends::atlas::capabilities() == 0, "no capability interface beyond chat");

    const auto* ops = lemon::backends::ops_for("atlas");
    CHECK(ops == lemon::backends::atlas::ops() && ops != lemon::backends::default_backend_ops(), "ops registered");
    CHECK(lemon::backends::spec_for("atlas") == nullptr, "no install spec");
    CHECK(ops->check_install("rocm", false).installed, "linked in: installed");
    CHECK(ops->resolve_version("cpu", "") == "v" + std::string(atlas_version()), ops->resolve_version("cpu", ""));
    const auto files = ops->select_checkpoint_files(
        "", {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "merges.txt", "README.md", "onnx/model.onnx"});
    CHECK(files && files->size() == 6, files ? std::to_string(files->size()) : "nullopt");
    CHECK(!ops->select_checkpoint_files("", {"model-Q8_0.gguf", "README.md"}), "GGUF repo: default selection");
    CHECK(!ops->select_checkpoint_files("Q8_0", {"model-Q8_0.gguf"}), "variant: default selection");

    lemon::backends::BackendContext ctx;
    ctx.log_level = "info";
    auto server = lemon::backends::create_server("atlas", ctx);
    CHECK(server && dynamic_cast<AtlasServer*>(server.get()) && server->get_descriptor() == &d, "create_server");
}

void test_server(const std::string& model_dir) {
    AtlasServer server("info", nullptr, nullptr);
    server.set_descriptor(&lemon::backends::atlas::descriptor);
    CHECK(!server.is_backend_alive() && server.get_backend_health_state() == "stopped", server.get_backend_health_state());
    CHECK(error_code(server.chat_completion(user_request("hi", 4))) == "model_not_loaded", "no model");

    const RecipeOptions options("atlas", {{"ctx_size", 512}, {"atlas_args", "--seed 1"}});
    const ModelInfo info = model_info("chat-tiny", model_dir);
    server.set_model_metadata("chat-tiny", model_dir, ModelType::LLM, lemon::DEVICE_GPU, options);
    server.load("chat-tiny", info, options);
    CHECK(server.is_backend_alive() && server.get_backend_health_state() == "ready", server.get_backend_health_state());
    // The device Atlas picked (auto) decides the device type Lemonade accounts the model under.
    CHECK(server.get_device_type() == lemon::DEVICE_CPU || server.get_device_type() == lemon::DEVICE_GPU, "device type");

    // Non-streaming: a whole chat.completion with usage and timings; Lemonade's load options stripped.
    json request = user_request("What is the capital of France?", 8);
    request["ctx_size"] = 512;
    const json answer = server.chat_completion(request);
    CHECK(answer.value("object", "") == "chat.completion", answer.dump());
    CHECK(answer.contains("usage") && answer["usage"].value("completion_tokens", -1) >= 1 &&
              answer["usage"].value("completion_tokens", 99) <= 8,
          answer.dump());
    CHECK(answer.contains("timings") && answer["timings"].contains("predicted_per_second"), answer.dump());
    const auto telemetry = StreamingProxy::extract_telemetry(answer);
    CHECK(telemetry.output_tokens >= 1 && telemetry.prompt_tokens > 0, "telemetry from the response");

    // Refusals come back as Lemonade error objects with the right status.
    json audio = user_request("hi", 4);
    audio["modalities"] = json::array({"text", "audio"});
    const json refused = server.chat_completion(audio);
    CHECK(error_code(refused) == "unsupported" && refused["error"]["status_code"] == 400, refused.dump());
    const json too_long = server.chat_completion(user_request("hi", 100000));  // beyond ctx_size 512
    CHECK(error_code(too_long) == "context_length_exceeded" && too_long["error"]["status_code"] == 400, too_long.dump());
    CHECK(error_code(server.completion(user_request("hi", 4))) == "model_not_applicable", "no /v1/completions");

    // Streaming: SSE frames, then [DONE]; the same greedy answer as the non-streaming one.
    json stream_request = user_request("What is the capital of France?", 8);
    stream_request["stream"] = true;
    FakeClient client;
    std::vector<StreamingProxy::TelemetryData> reports;
    server.forward_streaming_request("/v1/chat/completions", stream_request.dump(), client.sink, true, 0,
                                     [&](const StreamingProxy::TelemetryData& t) { reports.push_back(t); });
    const auto events = client.events();
    CHECK(events.size() >= 3 && events.back() == "[DONE]" && client.done, client.bytes);
    bool all_chunks = true;
    for (std::size_t i = 0; i + 1 < events.size(); i++) {
        const json chunk = json::parse(events[i], nullptr, false);
        all_chunks = all_chunks && chunk.is_object() && chunk.value("object", "") == "chat.completion.chunk";
    }
    CHECK(all_chunks, client.bytes);
    CHECK(streamed_content(events) == message_content(answer),
          "streamed '" + streamed_content(events) + "' vs '" + message_content(answer) + "'");
    CHECK(reports.size() == 1 && reports[0].error_message.empty() && reports[0].output_tokens >= 1 &&
              reports[0].model_name == "chat-tiny" && reports[0].tokens_per_second > 0,
          reports.empty() ? "no telemetry" : reports[0].error_message);

    // The client goes away after two frames: generation stops, nothing more is written.
    FakeClient gone;
    gone.write_limit = 2;
    reports.clear();
    json long_request = user_request("Tell me a long story.", 64);
    long_request["stream"] = true;
    server.forward_streaming_request("/v1/chat/completions", long_request.dump(), gone.sink, true, 0,
                                     [&](const StreamingProxy::TelemetryData& t) { reports.push_back(t); });
    CHECK(gone.writes == 2 && !contains(gone.bytes, "[DONE]"), gone.bytes);
    CHECK(reports.size() == 1 && contains(reports[0].error_message, "disconnected"), "cancel telemetry");
    CHECK(server.get_backend_health_state() == "ready", server.get_backend_health_state());
    CHECK(message_content(server.chat_completion(user_request("What is the capital of France?", 8))) ==
              message_content(answer),
          "still answers the same after a cancelled stream");

    // Lemonade's per-request cancel flag stops a non-streaming request too.
    std::atomic<bool> cancel{true};
    AtlasServer::set_request_cancel_flag(&cancel);
    const json cancelled = server.chat_completion(user_request("Tell me a long story.", 64));
    AtlasServer::set_request_cancel_flag(nullptr);
    CHECK(error_code(cancelled) == "cancelled" && cancelled["error"]["status_code"] == 499, cancelled.dump());

    // Errors in the streaming path are one error frame, then done.
    FakeClient bad;
    json bad_request = user_request("hi", 4);
    bad_request["n"] = 17;  // more choices than a request may ask for: refused before anything is streamed
    server.forward_streaming_request("/v1/chat/completions", bad_request.dump(), bad.sink, true, 0, nullptr);
    const auto bad_events = bad.events();
    CHECK(bad_events.size() == 1 && bad.done && contains(bad_events[0], "\"error\"") && !contains(bad.bytes, "[DONE]"),
          bad.bytes);
    FakeClient other;
    server.forward_streaming_request("/v1/completions", "{}", other.sink, true, 0, nullptr);
    CHECK(other.events().size() == 1 && contains(other.bytes, "model_not_applicable") && other.done, other.bytes);

    // Downsize drops the KV cache and keeps the model serving.
    CHECK(server.downsize(), "downsize");
    CHECK(server.is_backend_alive() && server.get_backend_health_state() == "ready", server.get_backend_health_state());
    server.restore();
    CHECK(message_content(server.chat_completion(user_request("What is the capital of France?", 8))) ==
              message_content(answer),
          "same answer after downsize");

    server.unload();
    CHECK(!server.is_backend_alive() && server.get_backend_health_state() == "stopped", server.get_backend_health_state());
    CHECK(error_code(server.chat_completion(user_request("hi", 4))) == "model_not_loaded", "unloaded");
    FakeClient after;
    server.forward_streaming_request("/v1/chat/completions", stream_request.dump(), after.sink, true, 0, nullptr);
    CHECK(after.events().size() == 1 && contains(after.bytes, "model_not_loaded") && after.done, after.bytes);

    // Load failures are exceptions with Atlas's message, as the router expects.
    EXPECT_THROW(std::runtime_error, "/nonexistent/model",
                 server.load("missing", model_info("missing", "/nonexistent/model"), options));
    EXPECT_THROW(std::invalid_argument, "--bogus",
                 server.load("chat-tiny", info, RecipeOptions("atlas", {{"atlas_args", "--bogus"}})));
    EXPECT_THROW(std::runtime_error, "pull the model", server.load("chat-tiny", model_info("chat-tiny", ""), options));
    CHECK(!server.is_backend_alive(), "failed loads leave nothing loaded");
}

void test_gguf(const std::string& gguf) {
    AtlasServer server("info", nullptr, nullptr);
    server.set_descriptor(&lemon::backends::atlas::descriptor);
    // An explicit choice goes through Lemonade's own validation (its system-info backends) first.
    const RecipeOptions options("atlas", {{"ctx_size", 1024}, {"atlas_backend", "cpu"}});
    CHECK(server.effective_device(options) == lemon::DEVICE_CPU, "cpu is accounted as CPU");
    server.set_model_metadata("smollm2", gguf, ModelType::LLM, lemon::DEVICE_GPU, options);
    server.load("smollm2", model_info("smollm2", gguf), options);
    CHECK(server.get_device_type() == lemon::DEVICE_CPU, "loaded on the CPU");
    json request = user_request("What is the capital of France?", 16);
    request["model"] = "smollm2";
    const json answer = server.chat_completion(request);
    std::printf("GGUF answer: %s\n", message_content(answer).c_str());
    CHECK(answer.value("object", "") == "chat.completion" && !message_content(answer).empty(), answer.dump());
    CHECK(answer.value("model", "") == "smollm2", answer.value("model", ""));

    lemon::ModelInfo meta = model_info("smollm2", gguf);
    lemon::backends::atlas::ops()->populate_metadata(meta, {});
    CHECK(meta.max_context_window > 0 && !meta.gguf.architecture.empty(), std::to_string(meta.max_context_window));
    CHECK(lemon::backends::atlas::ops()->validate_checkpoint_file(gguf).empty(), "GGUF magic");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL_DIR [GGUF_FILE]\n", argv[0]);
        return 2;
    }
    const std::string model_dir = argv[1];
    try {
        test_building_blocks(model_dir);
        test_descriptor_and_registry();
        test_server(model_dir);
        if (argc > 2) test_gguf(argv[2]);
    } catch (const std::exception& e) {
        failed++;
        std::fprintf(stderr, "FAIL uncaught exception: %s\n", e.what());
    }
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
