#pragma once

// AtlasServer: Lemonade's WrappedServer for Atlas, which runs inside lemond through libatlas instead
// of as a subprocess behind a port. It lives at src/cpp/include/lemon/backends/atlas/atlas_server.h in
// a Lemonade tree; the implementation is server/backends/atlas/atlas_server.cpp.
//
// Like Lemonade's cloud backend (the other backend with no local process), it answers liveness and
// health itself and serves the streaming path without StreamingProxy: chunks from atlas::Model are
// written to Lemonade's sink as SSE frames.
//
// This header names the Atlas C++ wrapper only through a forward declaration, so the code that
// merely includes it (the generated registries, BackendModeContractTest) needs no Atlas headers.
// Inside namespace lemon::backends, "atlas" is this backend's namespace: the wrapper is ::atlas.

#include "lemon/backends/atlas/atlas.h"
#include "lemon/backends/backend_registry.h"
#include "lemon/wrapped_server.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace atlas {
class Model;
}  // namespace atlas

namespace lemon {
namespace backends {

class AtlasServer : public WrappedServer {
public:
    AtlasServer(const std::string& log_level, ModelManager* model_manager, BackendManager* backend_manager);
    ~AtlasServer() override;

    // Loads model_info.resolved_path() (a model directory or a .gguf file) with ctx_size, the
    // atlas_backend choice (device) and atlas_args (--threads, --seed) from the recipe options.
    // Throws std::runtime_error / std::invalid_argument with Atlas's own message on failure.
    void load(const std::string& model_name, const ModelInfo& model_info, const RecipeOptions& options,
              bool do_not_upgrade = false) override;
    void unload() override;

    // Nothing runs on a port: alive means a model is loaded in this process.
    bool is_backend_alive() const override;
    // "ready", "busy" (a request is running), or "stopped" (no model).
    std::string get_backend_health_state() const override;

    // Soft-idle downsize: drops the KV cache (the cached conversation prefix). The C ABI has no call
    // for that alone, so the model is unloaded and loaded again with the same options. restore()
    // loads it again only if that reload failed.
    bool downsize() override;
    void restore() override;

    DeviceType effective_device(const RecipeOptions& options) const override;

    // OpenAI chat completions: the request goes to Atlas as JSON, the chat.completion (with usage
    // and llama.cpp-style timings) comes back. Failures come back as Lemonade error objects.
    json chat_completion(const json& request) override;
    json completion(const json& request) override;  // unsupported: Atlas serves chat only
    json responses(const json& request) override;   // unsupported

    // Streams /v1/chat/completions as "data: {chunk}\n\n" frames, then "data: [DONE]\n\n" (or one
    // error frame), and reports telemetry from the final response. A sink that stops accepting
    // writes (the client went away) cancels the generation.
    void forward_streaming_request(const std::string& endpoint, const std::string& request_body,
                                   httplib::DataSink& sink, bool sse = true, long timeout_seconds = 0,
                                   TelemetryCallback telemetry_callback = nullptr) override;

    // Building blocks, public so they can be tested without a model.
    // rocm -> "hip", cuda -> "cuda", cpu -> "cpu", "" or auto -> "auto"; anything else throws
    // std::invalid_argument.
    static std::string device_for_backend(const std::string& backend);
    // atlas_args ("--threads 8 --seed 1") -> {"threads": 8, "seed": 1}; throws std::invalid_argument
    // for anything else (ctx size and device have their own Lemonade options).
    static json parse_atlas_args(const std::string& args);
    // The atlas_load() options for a model path and Lemonade recipe options.
    static json load_options_for(const std::string& model_path, const RecipeOptions& options);
    // The request as Atlas should see it: Lemonade's own load options (ctx_size, *_backend, ...)
    // removed, since Lemonade has already applied them; Atlas refuses keys it does not know.
    static json sanitize_request(const json& request);
    // A Lemonade/OpenAI error object for an Atlas status and message.
    static json error_response(int32_t atlas_status, const std::string& message);

private:
    std::shared_ptr<::atlas::Model> current_model() const;
    static std::shared_ptr<::atlas::Model> open_model(const json& load_options);
    void reload_after_downsize() noexcept;

    mutable std::mutex model_mutex_;         // guards model_, load_options_ and standby_
    std::shared_ptr<::atlas::Model> model_;  // requests hold a copy while they run
    json load_options_;                      // what model_ was loaded with (for downsize/restore)
    bool standby_ = false;                   // dropped by downsize(), to be loaded again by restore()
    std::mutex lifecycle_mutex_;             // serializes load, unload, downsize and restore
    std::atomic<int> active_requests_{0};
};

namespace atlas {
// What Lemonade's generated registries need from a backend's namespace (lemond only).
std::unique_ptr<WrappedServer> create(const BackendContext& ctx);
const BackendSpec* spec();  // nullptr: nothing to download or install
const BackendOps* ops();
constexpr uint32_t capabilities() { return capability_mask_of<AtlasServer>(); }
}  // namespace atlas

}  // namespace backends
}  // namespace lemon
