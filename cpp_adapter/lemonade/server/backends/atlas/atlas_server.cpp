// AtlasServer: Atlas inside lemond. Lives at src/cpp/server/backends/atlas/atlas_server.cpp in a
// Lemonade tree (compiled into lemond by the "atlas|atlas" entry of LEMON_BACKENDS) and links the
// Atlas C++ wrapper (atlas::cpp, cpp_adapter/ of the Atlas repository) over libatlas.

#include "lemon/backends/atlas/atlas_server.h"

#include "atlas/atlas.hpp"

#include "lemon/backends/backend_ops.h"
#include "lemon/backends/hf_cache_util.h"
#include "lemon/backends/llamacpp/llamacpp_gguf.h"
#include "lemon/error_types.h"
#include "lemon/gguf_reader.h"
#include "lemon/recipe_options.h"
#include "lemon/runtime_config.h"
#include "lemon/streaming_proxy.h"
#include "lemon/utils/aixlog.hpp"
#include "lemon/utils/custom_args.h"
#include "lemon/utils/path_utils.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fs = std::filesystem;

namespace lemon {
namespace backends {

namespace {

constexpr const char* kTag = "Atlas";

// Counts a request for get_backend_health_state() while it runs.
class RequestCount {
public:
    explicit RequestCount(std::atomic<int>& n) : n_(n) { ++n_; }
    ~RequestCount() { --n_; }
    RequestCount(const RequestCount&) = delete;
    RequestCount& operator=(const RequestCount&) = delete;

private:
    std::atomic<int>& n_;
};

std::string lower(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return s;
}

bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// One SSE event; false when the client is gone (or the sink cannot be written).
bool write_frame(httplib::DataSink& sink, const std::string& payload) {
    const std::string frame = "data: " + payload + "\n\n";
    return sink.write && sink.write(frame.data(), frame.size());
}

void finish(httplib::DataSink& sink) {
    if (sink.done) sink.done();
}

StreamingProxy::TelemetryData error_telemetry(const std::string& message) {
    StreamingProxy::TelemetryData telemetry;
    telemetry.error_message = message;
    return telemetry;
}

// A whole number for an atlas_args flag, at least `min`.
int64_t parse_count(const std::string& flag, const std::string& value, int64_t min) {
    std::size_t used = 0;
    long long n = 0;
    try {
        n = std::stoll(value, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (used == 0 || used != value.size() || n < min) {
        throw std::invalid_argument("atlas_args: " + flag + " needs a whole number >= " + std::to_string(min) +
                                    ", got '" + value + "'");
    }
    return n;
}

// The explicit atlas_backend choice of these options, or "" when none (unset or "auto").
std::string explicit_backend(const RecipeOptions& options) {
    const json set = options.to_json();
    const auto it = set.find("atlas_backend");
    if (it == set.end() || !it->is_string()) return "";
    const std::string backend = lower(it->get<std::string>());
    return backend == "auto" ? "" : backend;
}

}  // namespace

AtlasServer::AtlasServer(const std::string& log_level, ModelManager* model_manager, BackendManager* backend_manager)
    : WrappedServer("atlas", log_level, model_manager, backend_manager) {}

AtlasServer::~AtlasServer() {
    unload();
}

// ---- building blocks -----------------------------------------------------------------------------

std::string AtlasServer::device_for_backend(const std::string& backend) {
    const std::string b = lower(backend);
    if (b.empty() || b == "auto") return "auto";
    if (b == "rocm") return "hip";
    if (b == "cuda") return "cuda";
    if (b == "cpu") return "cpu";
    throw std::invalid_argument("Atlas backend '" + backend + "' is not one of auto, rocm, cuda, cpu");
}

json AtlasServer::parse_atlas_args(const std::string& args) {
    json out = json::object();
    const std::vector<std::string> tokens = utils::parse_custom_args(args);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
        std::string flag = tokens[i];
        std::optional<std::string> inline_value;
        const auto eq = flag.find('=');
        if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
            inline_value = flag.substr(eq + 1);
            flag = flag.substr(0, eq);
        }
        auto value = [&]() -> std::string {
            if (inline_value) return *inline_value;
            if (i + 1 >= tokens.size()) throw std::invalid_argument("atlas_args: " + flag + " needs a value");
            return tokens[++i];
        };
        if (flag == "--threads" || flag == "-t") {
            out["threads"] = parse_count(flag, value(), 1);
        } else if (flag == "--seed" || flag == "-s") {
            out["seed"] = parse_count(flag, value(), 0);
        } else if (flag == "--ctx-size" || flag == "-c") {
            throw std::invalid_argument("atlas_args: the context size is Lemonade's ctx_size option (--ctx-size), "
                                        "not an Atlas argument");
        } else if (flag == "--device" || flag == "--model" || flag == "-m") {
            throw std::invalid_argument("atlas_args: " + flag + " is managed by Lemonade (--atlas picks the device, "
                                        "the model comes from its checkpoint)");
        } else {
            throw std::invalid_argument("atlas_args: unknown argument '" + tokens[i] +
                                        "' (Atlas takes --threads N and --seed N)");
        }
    }
    return out;
}

json AtlasServer::load_options_for(const std::string& model_path, const RecipeOptions& options) {
    json load = {{"model", model_path}, {"device", device_for_backend(explicit_backend(options))}};
    const json ctx_size = options.get_option("ctx_size");
    if (ctx_size.is_number() && ctx_size.get<double>() > 0) {
        load["ctx_size"] = static_cast<int64_t>(ctx_size.get<double>());
    }
    const json args = options.get_option("atlas_args");
    if (args.is_string()) {
        const json extra = parse_atlas_args(args.get<std::string>());
        for (const auto& [key, value] : extra.items()) {
            load[key] = value;
        }
    }
    return load;
}

json AtlasServer::sanitize_request(const json& request) {
    json out = request;
    if (!out.is_object()) return out;
    // Load options a client may send along (ctx_size, per-recipe options): Lemonade consumed them
    // when it loaded the model; Atlas would refuse them as unknown request fields.
    for (const auto& key : RecipeOptions::known_keys()) {
        out.erase(key);
    }
    // Atlas always reuses the cached conversation prefix, so cache_prompt: true is honoured as is.
    // cache_prompt: false stays in and is refused by Atlas, which cannot honour it.
    const auto cache_prompt = out.find("cache_prompt");
    if (cache_prompt != out.end() && cache_prompt->is_boolean() && cache_prompt->get<bool>()) {
        out.erase(cache_prompt);
    }
    return out;
}

json AtlasServer::error_response(int32_t atlas_status, const std::string& message) {
    std::string type = ErrorType::BACKEND_ERROR;
    std::string code;
    int http_status = 500;
    switch (static_cast<AtlasStatus>(atlas_status)) {
        case ATLAS_STATUS_INVALID_ARGUMENT:
        case ATLAS_STATUS_INVALID_REQUEST:
            type = "invalid_request_error";
            code = "invalid_request";
            http_status = 400;
            break;
        case ATLAS_STATUS_CONTEXT_OVERFLOW:
            type = "invalid_request_error";
            code = "context_length_exceeded";
            http_status = 400;
            break;
        case ATLAS_STATUS_UNSUPPORTED:
            type = ErrorType::UNSUPPORTED_OPERATION;
            code = "unsupported";
            http_status = 400;
            break;
        case ATLAS_STATUS_CANCELLED:
            code = "cancelled";
            http_status = 499;  // the client closed the request
            break;
        case ATLAS_STATUS_MODEL_LOAD:
            code = "model_load_error";
            break;
        case ATLAS_STATUS_DEVICE:
            code = "device_error";
            break;
        case ATLAS_STATUS_CACHE_FULL:
            code = "kv_cache_full";
            http_status = 503;  // busy: the same request fits once other sequences finish
            break;
        default:
            code = "internal_error";
            break;
    }
    return json{{"error",
                 {{"message", message},
                  {"type", type},
                  {"code", code},
                  {"status_code", http_status},
                  {"backend", "atlas"},
                  {"atlas_status", ::atlas::status_name(static_cast<AtlasStatus>(atlas_status))}}}};
}

// ---- lifecycle -----------------------------------------------------------------------------------

std::shared_ptr<::atlas::Model> AtlasServer::open_model(const json& load_options) {
    try {
        return std::make_shared<::atlas::Model>(load_options.dump());
    } catch (const ::atlas::Error& e) {
        throw std::runtime_error("Atlas could not load " + load_options.value("model", std::string()) + ": " +
                                 e.what() + " (" + ::atlas::status_name(e.code()) + ")");
    }
}

std::shared_ptr<::atlas::Model> AtlasServer::current_model() const {
    std::lock_guard<std::mutex> lock(model_mutex_);
    return model_;
}

void AtlasServer::load(const std::string& model_name, const ModelInfo& model_info, const RecipeOptions& options,
                       bool /*do_not_upgrade: nothing to install*/) {
    std::lock_guard<std::mutex> lifecycle(lifecycle_mutex_);
    LOG(INFO, kTag) << "Loading model: " << model_name << " (libatlas " << ::atlas::version() << ")" << std::endl;
    LOG(DEBUG, kTag) << "Per-model settings: " << options.to_log_string() << std::endl;

    const std::string path = model_info.resolved_path();
    if (path.empty()) {
        throw std::runtime_error("Atlas: no local files for checkpoint '" + model_info.checkpoint() + "' of model '" +
                                 model_name + "'; pull the model first");
    }
    const std::string backend = explicit_backend(options);
    if (!backend.empty()) {
        // Same check (and message) as every selectable backend: the choice must be supported here.
        RuntimeConfig::validate_backend_choice(descriptor_ ? descriptor_->effective_config_section() : "atlas",
                                               backend);
    }
    const json load_options = load_options_for(path, options);
    LOG(DEBUG, kTag) << "atlas_load options: " << load_options.dump() << std::endl;

    std::shared_ptr<::atlas::Model> model = open_model(load_options);
    if (load_cancel_ && load_cancel_->load()) {
        throw std::runtime_error("Atlas: loading " + model_name + " was cancelled");  // drops the model
    }

    std::string device = load_options.value("device", std::string("auto"));
    try {
        const json info = json::parse(model->info());
        device = info.value("device", device);
        LOG(INFO, kTag) << "Loaded " << info.value("architecture", std::string("model")) << " on " << device
                        << ", context " << info.value("ctx_size", 0) << " tokens" << std::endl;
        for (const auto& note : info.value("notes", json::array())) {
            if (note.is_string()) LOG(WARNING, kTag) << note.get<std::string>() << std::endl;
        }
    } catch (const std::exception& e) {
        LOG(WARNING, kTag) << "Model info unavailable: " << e.what() << std::endl;
    }
    const std::string d = lower(device);  // e.g. "cpu (2 threads)"
    if (d.rfind("cpu", 0) == 0) {
        device_type_ = DEVICE_CPU;
    } else if (d.find("hip") != std::string::npos || d.find("cuda") != std::string::npos ||
               d.find("rocm") != std::string::npos || d.find("gpu") != std::string::npos) {
        device_type_ = DEVICE_GPU;
    }

    std::shared_ptr<::atlas::Model> previous;  // a model loaded before, released outside the lock
    {
        std::lock_guard<std::mutex> lock(model_mutex_);
        previous = std::exchange(model_, std::move(model));
        load_options_ = load_options;
        standby_ = false;
    }
}

void AtlasServer::unload() {
    std::lock_guard<std::mutex> lifecycle(lifecycle_mutex_);
    std::shared_ptr<::atlas::Model> old;
    {
        std::lock_guard<std::mutex> lock(model_mutex_);
        old = std::move(model_);
        model_.reset();
        load_options_ = json();
        standby_ = false;
    }
    if (old) {
        LOG(INFO, kTag) << "Unloading model: " << model_name_ << std::endl;
    }
    // atlas_unload() runs when the last holder lets go; it waits for a request still running.
    old.reset();
}

bool AtlasServer::is_backend_alive() const {
    std::lock_guard<std::mutex> lock(model_mutex_);
    return model_ != nullptr || standby_;
}

std::string AtlasServer::get_backend_health_state() const {
    {
        std::lock_guard<std::mutex> lock(model_mutex_);
        if (!model_) return standby_ ? "downsized" : "stopped";
    }
    return active_requests_.load() > 0 ? "busy" : "ready";
}

bool AtlasServer::downsize() {
    std::lock_guard<std::mutex> lifecycle(lifecycle_mutex_);
    json options;
    {
        std::lock_guard<std::mutex> lock(model_mutex_);
        if (!model_) return true;
        options = load_options_;
        // Lemonade downsizes idle models only, so this is the last reference: the model and its KV
        // cache are released here. standby_ keeps the backend "alive" for the router meanwhile.
        model_.reset();
        standby_ = true;
    }
    LOG(INFO, kTag) << "Downsizing " << model_name_ << ": dropping the KV cache (reload)" << std::endl;
    try {
        std::shared_ptr<::atlas::Model> model = open_model(options);
        std::lock_guard<std::mutex> lock(model_mutex_);
        model_ = std::move(model);
        standby_ = false;
    } catch (const std::exception& e) {
        // Downsized all the same (memory released); restore() tries again before the next request.
        LOG(WARNING, kTag) << "Reload after downsize failed, retrying on the next request: " << e.what() << std::endl;
    }
    return true;
}

void AtlasServer::restore() {
    std::lock_guard<std::mutex> lifecycle(lifecycle_mutex_);
    reload_after_downsize();
}

void AtlasServer::reload_after_downsize() noexcept {
    json options;
    {
        std::lock_guard<std::mutex> lock(model_mutex_);
        if (model_ || !standby_) return;
        options = load_options_;
    }
    try {
        std::shared_ptr<::atlas::Model> model = open_model(options);
        std::lock_guard<std::mutex> lock(model_mutex_);
        model_ = std::move(model);
        standby_ = false;
    } catch (const std::exception& e) {
        // Not alive any more: the router reloads the model through load() on the next request and
        // reports what goes wrong there. restore() itself must not throw (acquire_for_inference).
        LOG(ERROR, kTag) << "Could not restore " << model_name_ << ": " << e.what() << std::endl;
        std::lock_guard<std::mutex> lock(model_mutex_);
        standby_ = false;
    }
}

DeviceType AtlasServer::effective_device(const RecipeOptions& options) const {
    std::string backend = explicit_backend(options);
    if (backend.empty()) {
        try {
            // Unset: Lemonade's preferred backend on this system (the first supported support row).
            const json resolved = options.get_option("atlas_backend");
            if (resolved.is_string()) backend = lower(resolved.get<std::string>());
        } catch (const std::exception&) {
        }
    }
    if (backend == "cpu") return DEVICE_CPU;
    return descriptor_ ? descriptor_->default_device : DEVICE_GPU;
}

// ---- requests ------------------------------------------------------------------------------------

json AtlasServer::chat_completion(const json& request) {
    const std::shared_ptr<::atlas::Model> model = current_model();
    if (!model) {
        return ErrorResponse::from_exception(ModelNotLoadedException(server_name_));
    }
    RequestCount count(active_requests_);
    json atlas_request = sanitize_request(request);
    std::atomic<bool>* cancel = current_request_cancel();
    try {
        std::string response;
        if (cancel) {
            // Only a streamed request can be cancelled mid-way (through its chunk sink): stream it
            // here, drop the chunks, and keep the whole chat.completion Atlas returns at the end.
            atlas_request["stream"] = true;
            response = model->chat_stream(atlas_request.dump(),
                                           [cancel](const std::string&) { return !cancel->load(); });
        } else {
            response = model->chat(atlas_request.dump());
        }
        return json::parse(response);
    } catch (const ::atlas::Error& e) {
        return error_response(e.code(), e.what());
    } catch (const json::exception& e) {
        return error_response(ATLAS_STATUS_INTERNAL, std::string("Atlas returned malformed JSON: ") + e.what());
    }
}

json AtlasServer::completion(const json& /*request*/) {
    return unsupported_capability_error("text completions (/v1/completions); use /v1/chat/completions");
}

json AtlasServer::responses(const json& /*request*/) {
    return unsupported_capability_error("the Responses API (/v1/responses); use /v1/chat/completions");
}

void AtlasServer::forward_streaming_request(const std::string& endpoint, const std::string& request_body,
                                            httplib::DataSink& sink, bool sse, long /*timeout_seconds*/,
                                            TelemetryCallback telemetry_callback) {
    auto fail = [&](const json& error) {
        const std::string message = error["error"].value("message", std::string("Atlas request failed"));
        write_frame(sink, error.dump());
        finish(sink);
        if (telemetry_callback) telemetry_callback(error_telemetry(message));
    };

    std::string path = endpoint;
    if (path.rfind("/api", 0) == 0) path = path.substr(4);
    if (!sse || path != "/v1/chat/completions") {
        fail(unsupported_capability_error("streaming " + endpoint + "; use /v1/chat/completions"));
        return;
    }
    const std::shared_ptr<::atlas::Model> model = current_model();
    if (!model) {
        fail(ErrorResponse::from_exception(ModelNotLoadedException(server_name_)));
        return;
    }
    json request;
    try {
        request = sanitize_request(json::parse(request_body));
    } catch (const json::exception& e) {
        fail(error_response(ATLAS_STATUS_INVALID_REQUEST, std::string("request is not valid JSON: ") + e.what()));
        return;
    }
    request["stream"] = true;  // chunks only flow for streamed requests

    RequestCount count(active_requests_);
    std::atomic<bool>* cancel = current_request_cancel();
    bool client_gone = false;
    try {
        const std::string response = model->chat_stream(request.dump(), [&](const std::string& chunk) {
            if (cancel && cancel->load()) return false;
            if (!write_frame(sink, chunk)) {
                client_gone = true;
                return false;
            }
            return true;
        });
        if (!sink.write || !sink.write("data: [DONE]\n\n", 14)) {
            client_gone = true;
        }
        finish(sink);
        if (telemetry_callback) {
            StreamingProxy::TelemetryData telemetry;
            try {
                telemetry = StreamingProxy::extract_telemetry(json::parse(response));
            } catch (const std::exception& e) {
                LOG(WARNING, kTag) << "No telemetry in the final response: " << e.what() << std::endl;
            }
            telemetry.model_name = get_model_name();
            telemetry_callback(telemetry);
        }
    } catch (const ::atlas::Error& e) {
        if (client_gone) {
            // Nobody is reading: write nothing more (as the cloud backend does on a dead client).
            LOG(INFO, kTag) << "Client disconnected during stream; generation cancelled" << std::endl;
            if (telemetry_callback) telemetry_callback(error_telemetry("Client disconnected during stream"));
            return;
        }
        LOG(ERROR, kTag) << "Streaming request failed: " << e.what() << std::endl;
        fail(error_response(e.code(), e.what()));
    } catch (const std::exception& e) {
        LOG(ERROR, kTag) << "Streaming request failed: " << e.what() << std::endl;
        if (client_gone) return;
        fail(error_response(ATLAS_STATUS_INTERNAL, e.what()));
    }
}

// ---- registry ------------------------------------------------------------------------------------

namespace atlas {

std::unique_ptr<WrappedServer> create(const BackendContext& ctx) {
    return make_server<AtlasServer>(ctx);
}

namespace {

bool is_gguf(const std::string& path) {
    return ends_with(lower(path), ".gguf");
}

// Model management without a running model: where the files are, which to download, metadata.
class AtlasOps : public BackendOps {
public:
    // A Hugging Face checkpoint without a variant ("Qwen/Qwen3-8B") is its snapshot directory,
    // loaded whole; a GGUF checkpoint ("repo:Q8_0", "repo:file.gguf") is one .gguf file, chosen
    // the way Lemonade's llama.cpp backend chooses it.
    std::string resolve_checkpoint_path(const ModelInfo& info, const CheckpointResolveContext& ctx) const override {
        if (ctx.type != "main") {
            return BackendOps::resolve_checkpoint_path(info, ctx);
        }
        if (ctx.variant.empty()) {
            const fs::path snapshot = hf_cache::active_snapshot_path(utils::path_from_utf8(ctx.model_cache_path));
            if (snapshot.empty() || hf_cache::exists(snapshot / "config.json")) {
                return BackendOps::resolve_checkpoint_path(info, ctx);
            }
        }
        return llamacpp::resolve_gguf_path(ctx.model_cache_path, ctx.variant);
    }

    std::string find_imported_checkpoint(const std::string& import_dir) const override {
        if (hf_cache::exists(utils::path_from_utf8(import_dir) / "config.json")) {
            return "";  // a model directory: register it as is
        }
        const std::string gguf = llamacpp::resolve_gguf_path(import_dir, "");
        return is_gguf(gguf) ? gguf : "";
    }

    // For a safetensors repository, only what Atlas reads: weights, index, configs, tokenizer and
    // chat template (not ONNX exports, training runs or other formats kept beside them).
    std::optional<std::vector<std::string>> select_checkpoint_files(
        const std::string& main_variant, const std::vector<std::string>& repo_files) const override {
        if (!main_variant.empty()) return std::nullopt;
        const bool safetensors = std::any_of(repo_files.begin(), repo_files.end(), [](const std::string& f) {
            return f.find('/') == std::string::npos && ends_with(f, ".safetensors");
        });
        if (!safetensors) return std::nullopt;  // a GGUF repository: Lemonade's default selection
        std::vector<std::string> selected;
        for (const auto& f : repo_files) {
            if (f.find('/') != std::string::npos) continue;
            if (ends_with(f, ".safetensors") || ends_with(f, ".json") || ends_with(f, ".jinja") ||
                ends_with(f, ".txt") || f == "tokenizer.model") {
                selected.push_back(f);
            }
        }
        return selected;
    }

    void populate_metadata(ModelInfo& info, const BackendOpsContext&) const override {
        const std::string path = info.resolved_path();
        if (path.empty()) return;
        std::error_code ec;
        const fs::path p = utils::path_from_utf8(path);
        if (is_gguf(path)) {
            GgufMetadata meta;
            if (fs::exists(p, ec) && read_gguf_metadata(meta, path)) {
                info.max_context_window = meta.context_length;
                info.gguf = std::move(meta);
            }
            return;
        }
        std::ifstream in(p / "config.json");
        if (!in) return;
        const json config = json::parse(in, nullptr, false);
        if (config.is_object() && config.contains("max_position_embeddings") &&
            config["max_position_embeddings"].is_number_integer()) {
            info.max_context_window = config["max_position_embeddings"].get<int64_t>();
        }
    }

    std::string validate_checkpoint_file(const std::string& resolved_path) const override {
        if (!is_gguf(resolved_path)) return "";
        std::ifstream in(utils::path_from_utf8(resolved_path), std::ios::binary);
        char magic[4] = {};
        in.read(magic, sizeof(magic));
        const bool ok = in.gcount() == 4 && magic[0] == 'G' && magic[1] == 'G' && magic[2] == 'U' && magic[3] == 'F';
        return ok ? "" : "Invalid GGUF cache file";
    }

    // libatlas is linked into lemond: every variant is present. Whether its device works is found
    // (and reported) when a model loads.
    InstallCheck check_install(const std::string& /*backend*/, bool /*binary_found*/) const override {
        return {true, ""};
    }

    std::string resolve_version(const std::string& /*backend*/, const std::string& /*file_version*/) const override {
        return "v" + ::atlas::version();
    }
};

}  // namespace

const BackendSpec* spec() {
    return nullptr;
}

const BackendOps* ops() {
    return single_ops<AtlasOps>();
}

}  // namespace atlas
}  // namespace backends
}  // namespace lemon
