#include "atlas/atlas.hpp"

#include <cstdint>
#include <exception>
#include <utility>

namespace atlas {
namespace {

// Owns a string the library returned; atlas_string_free() ignores NULL, as does unique_ptr.
struct StringFree {
    void operator()(char* s) const noexcept { atlas_string_free(s); }
};
using LibString = std::unique_ptr<char, StringFree>;

std::string text(const LibString& s) { return s ? std::string(s.get()) : std::string(); }

// Turns a status and its message into a return or an Error. Both strings are already owned, so
// they are freed whichever way this leaves.
void check(std::int32_t status, const LibString& error) {
    if (status == ATLAS_STATUS_OK) return;
    const auto code = static_cast<AtlasStatus>(status);
    throw Error(code, error ? text(error) : "atlas: " + status_name(code));
}

// JSON string literal for s (the model path may hold quotes, backslashes or control characters).
std::string json_quote(const std::string& s) {
    static const char hex[] = "0123456789abcdef";
    std::string out = "\"";
    for (const char ch : s) {
        const auto c = static_cast<unsigned char>(ch);
        if (c == '"' || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c < 0x20) {
            out += "\\u00";
            out += hex[c >> 4];
            out += hex[c & 0xf];
        } else {
            out += static_cast<char>(c);
        }
    }
    return out + "\"";
}

// What the C callback's user_data points to during one chat_stream() call.
struct Stream {
    const ChunkSink& sink;
    std::exception_ptr error;  // thrown by sink; rethrown after the C call returns
};

extern "C" {
// C language linkage because the library calls it through a C function pointer. It must not let
// an exception escape: unwinding through the Rust frames below it would be undefined behaviour.
static std::int32_t on_chunk(const char* chunk_json, void* user_data) noexcept {
    auto* stream = static_cast<Stream*>(user_data);
    try {
        return stream->sink(chunk_json) ? 0 : 1;
    } catch (...) {
        stream->error = std::current_exception();
        return 1;  // cancel
    }
}
}

}  // namespace

std::string status_name(AtlasStatus code) {
    switch (code) {
        case ATLAS_STATUS_OK: return "ATLAS_STATUS_OK";
        case ATLAS_STATUS_INVALID_ARGUMENT: return "ATLAS_STATUS_INVALID_ARGUMENT";
        case ATLAS_STATUS_INVALID_REQUEST: return "ATLAS_STATUS_INVALID_REQUEST";
        case ATLAS_STATUS_MODEL_LOAD: return "ATLAS_STATUS_MODEL_LOAD";
        case ATLAS_STATUS_UNSUPPORTED: return "ATLAS_STATUS_UNSUPPORTED";
        case ATLAS_STATUS_CONTEXT_OVERFLOW: return "ATLAS_STATUS_CONTEXT_OVERFLOW";
        case ATLAS_STATUS_DEVICE: return "ATLAS_STATUS_DEVICE";
        case ATLAS_STATUS_CANCELLED: return "ATLAS_STATUS_CANCELLED";
        case ATLAS_STATUS_INTERNAL: return "ATLAS_STATUS_INTERNAL";
        case ATLAS_STATUS_CACHE_FULL: return "ATLAS_STATUS_CACHE_FULL";
    }
    return "ATLAS_STATUS_" + std::to_string(static_cast<std::int32_t>(code));
}

std::string version() { return atlas_version(); }

unsigned abi_version() { return atlas_abi_version(); }

Model::Model(const std::string& options_json) {
    // A library built from another atlas.h would misread every call: refuse it up front.
    if (atlas_abi_version() != ATLAS_ABI_VERSION) {
        throw Error(ATLAS_STATUS_UNSUPPORTED, "libatlas implements C ABI version " + std::to_string(atlas_abi_version()) +
                                                  ", atlas.h describes version " + std::to_string(ATLAS_ABI_VERSION));
    }
    AtlasModel* model = nullptr;
    char* error = nullptr;
    const std::int32_t status = atlas_load(options_json.c_str(), &model, &error);
    handle_.reset(model);  // NULL unless status is OK
    check(status, LibString(error));
}

Model::Model(const std::string& model_dir, const std::string& device, std::size_t ctx_size)
    : Model("{\"model\":" + json_quote(model_dir) + ",\"device\":" + json_quote(device) +
            (ctx_size ? ",\"ctx_size\":" + std::to_string(ctx_size) : std::string()) + "}") {}

std::string Model::chat(const std::string& request_json) const {
    char* response = nullptr;
    char* error = nullptr;
    const std::int32_t status =
        atlas_chat_completion(handle_.get(), request_json.c_str(), nullptr, nullptr, &response, &error);
    LibString owned_response(response), owned_error(error);
    check(status, owned_error);
    return text(owned_response);
}

std::string Model::chat_stream(const std::string& request_json, const ChunkSink& sink) const {
    if (!sink) return chat(request_json);
    Stream stream{sink, nullptr};
    char* response = nullptr;
    char* error = nullptr;
    const std::int32_t status =
        atlas_chat_completion(handle_.get(), request_json.c_str(), on_chunk, &stream, &response, &error);
    LibString owned_response(response), owned_error(error);
    // The sink's own exception explains the cancellation better than ATLAS_STATUS_CANCELLED does.
    if (stream.error) std::rethrow_exception(stream.error);
    check(status, owned_error);
    return text(owned_response);
}

std::string Model::info() const {
    char* info = nullptr;
    char* error = nullptr;
    const std::int32_t status = atlas_model_info(handle_.get(), &info, &error);
    LibString owned_info(info), owned_error(error);
    check(status, owned_error);
    return text(owned_info);
}

}  // namespace atlas
