#pragma once

// The Atlas backend descriptor for Lemonade (lemonade-sdk/lemonade): what the backend is, as plain
// data. It lives at src/cpp/include/lemon/backends/atlas/atlas.h in a Lemonade tree, is registered by
// the "atlas|atlas" entry of LEMON_BACKENDS, and is read by both lemond and the lemonade CLI, so it
// must stay header-only and free of Atlas's own headers. How it runs: atlas_server.h beside it.
//
// Atlas runs inside lemond (libatlas, through the C ABI in atlas.h of the Atlas repository): there is
// no subprocess to download, launch or probe, hence no binary and no install spec. The "<recipe>_backend"
// choice (--atlas auto|rocm|cuda|cpu) picks the device Atlas computes on: rocm -> "hip", cuda -> "cuda",
// cpu -> "cpu"; auto (or no choice) lets Atlas pick.

#include "lemon/backends/backend_descriptor.h"

namespace lemon {
namespace backends {
namespace atlas {

inline const BackendDescriptor descriptor = {
    /*recipe*/          "atlas",
    /*display_name*/    "Atlas",
    /*binary*/          "",  // in-process: libatlas is linked into lemond, nothing to launch or install
    /*config_section*/  "",  // defaults to the recipe: config.json "atlas": {"backend": ..., "args": ...}
    /*default_device*/  DEVICE_GPU,  // "cpu" resolves to DEVICE_CPU through AtlasServer::effective_device()
    /*slot_policy*/     SlotPolicy::Standard,
    /*selectable_backend*/ true,
    /*uses_ctx_size*/   true,
    /*dynamic_models*/  false,
    /*options*/ {
        {"atlas_backend", "--atlas", "", "BACKEND",
         "Atlas backend to use: auto, rocm, cuda or cpu", "Atlas Backend Options"},
        {"atlas_args", "--atlas-args", "", "ARGS",
         "Extra Atlas load options: --threads N, --seed N", "Atlas Backend Options"},
    },
    // First listed = preferred when the choice is auto. Every device family of a type is accepted:
    // Atlas loads its GPU runtime (HIP or CUDA) itself at load time and reports what it cannot use.
    /*support*/ {
        {"rocm", {"windows", "linux"}, {{"amd_gpu", {}}}, "AMD GPUs (HIP)"},
        {"cuda", {"windows", "linux"}, {{"nvidia_gpu", {}}}, "NVIDIA GPUs (CUDA)"},
        {"cpu", {"windows", "linux"}, {{"cpu", {"x86_64", "arm64"}}}, "x86_64 CPU; ARM64 CPU"},
    },
    /*supported_modes*/ {"chat"},
    /*required_checkpoints*/ {"main"},  // a Hugging Face safetensors directory or one .gguf file
    /*default_capabilities*/ {},
    /*experimental*/    true,
    /*web_display_name*/ "Atlas",
    /*rocm_channels*/   {},  // a single ROCm build: the library itself
    /*exposes_prometheus_metrics*/ false,
    /*rocm_requires_cwsr_fix*/ false,
    // The pin in backend_versions.json is the oldest libatlas this glue works with; a newer library
    // linked into lemond is fine (libatlas checks its C ABI version itself at load).
    /*version_policy*/  VersionPolicy::AtLeast,
    /*self_manages_downloads*/ false,
    /*takes_args*/      true,
    /*arg_variants*/    {},
    /*bin_variants*/    {},  // no binary to pin
    /*config_extra*/    nlohmann::json::object(),
};

}  // namespace atlas
}  // namespace backends
}  // namespace lemon
