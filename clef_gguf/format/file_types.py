"""The file types convert writes, by their llama.cpp names: data, in a module that imports nothing, so that
`convert --help` and the other commands load no converter."""

# llama.cpp's quantizations (conversion/quantize.py), each llama_ftype constant LLAMA_FTYPE_MOSTLY_<NAME>, looked up
# when a file is quantized. Types that need an importance matrix (IQ1/IQ2/IQ3) are left out.
LLAMA_FILE_TYPES = (
    "q4_k_m",
    "q4_k_s",
    "q5_k_m",
    "q5_k_s",
    "q6_k",
    "q3_k_m",
    "q3_k_l",
    "q2_k",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "iq4_nl",
    "iq4_xs",
)
FILE_TYPES = (*LLAMA_FILE_TYPES, "f32", "f16", "bf16", "q8_0")  # then those conversion/convert.py writes itself
DEFAULT_FILE_TYPE = "q4_k_m"
ADAPTER_FILE_TYPES = ("f32", "f16", "q8_0")  # an adapter file's LoRA (conversion/adapter.py)
DEFAULT_ADAPTER_TYPE = "f16"
