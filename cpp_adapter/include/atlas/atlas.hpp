// A C++17 RAII wrapper over the Atlas C ABI (atlas.h). Nothing here depends on Lemonade.
//
//   atlas::Model model("models/Qwen3-0.6B", "auto");
//   std::string reply = model.chat(R"({"messages":[{"role":"user","content":"Hi"}]})");
//
// Requests and responses are OpenAI chat-completions JSON, passed through as text: the wrapper
// parses nothing. Every failure is thrown as atlas::Error, carrying the library's status code.
// Threads: the library queues concurrent requests on one model, so chat(), chat_stream() and info()
// may be called from several threads at once on the same Model (they are const for that reason);
// moving or destroying a Model must not race with them.
#ifndef ATLAS_ATLAS_HPP
#define ATLAS_ATLAS_HPP

#include <atlas.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

namespace atlas {

// A failed library call: code() is the AtlasStatus, what() the library's message.
class Error : public std::runtime_error {
public:
    Error(AtlasStatus code, const std::string& message) : std::runtime_error(message), code_(code) {}
    AtlasStatus code() const noexcept { return code_; }

private:
    AtlasStatus code_;
};

// "ATLAS_STATUS_CANCELLED" and so on, for logs; "ATLAS_STATUS_<n>" for unknown codes.
std::string status_name(AtlasStatus code);

// The library's version ("0.1.0") and the ABI version it implements (compare with ATLAS_ABI_VERSION).
std::string version();
unsigned abi_version();

// Receives the JSON text of one chat.completion.chunk; returns false to cancel the request.
using ChunkSink = std::function<bool(const std::string& chunk_json)>;

// A loaded model; unloaded by the destructor. Move-only: a moved-from Model is empty, and calls
// on it throw Error(ATLAS_STATUS_INVALID_ARGUMENT).
class Model {
public:
    // options_json: {"model": DIR, "device": "auto"|"cpu"|"hip"|"cuda", "ctx_size": N,
    // "threads": N, "seed": N}, as atlas_load() documents; only "model" is required.
    explicit Model(const std::string& options_json);
    // The common case; device is "auto", "cpu", "hip" or "cuda"; ctx_size 0 keeps the model's default.
    Model(const std::string& model_dir, const std::string& device, std::size_t ctx_size = 0);

    Model(Model&&) noexcept = default;
    Model& operator=(Model&&) noexcept = default;
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;
    ~Model() = default;  // the handle's deleter calls atlas_unload(), which waits for running requests

    explicit operator bool() const noexcept { return handle_ != nullptr; }

    // Runs a chat-completions request and returns the chat.completion JSON. A request with
    // "stream": true is run to the end and answered the same way, with no chunks delivered.
    [[nodiscard]] std::string chat(const std::string& request_json) const;

    // Like chat(), and passes each chat.completion.chunk to sink as it is generated. Chunks only
    // flow when the request contains "stream": true; without it this is chat() and sink is never
    // called. sink returning false cancels: Error(ATLAS_STATUS_CANCELLED) is thrown. An exception
    // thrown by sink cancels the request too and is rethrown here, unchanged, once the library
    // has returned. The sink runs on the calling thread, while the model is busy: calling into
    // the same Model from it would deadlock. An empty sink makes this chat().
    std::string chat_stream(const std::string& request_json, const ChunkSink& sink) const;

    // The model description as JSON (device, architecture, context size, ...).
    [[nodiscard]] std::string info() const;

private:
    struct Unload {
        void operator()(AtlasModel* model) const noexcept { atlas_unload(model); }
    };
    std::unique_ptr<AtlasModel, Unload> handle_;
};

}  // namespace atlas

#endif  // ATLAS_ATLAS_HPP
