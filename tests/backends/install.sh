#!/usr/bin/env bash
# Installs the real inference servers that tests/backends/servers.py starts for the adapter tests,
# each in its own virtual environment under $IOP_BACKENDS_DIR (default ~/.cache/iop-backends),
# apart from the project's .venv and never inside the repository:
#   llama/   llama-cpp-python[server] (an OpenAI-compatible server, for the vllm adapter) + gguf + numpy
#   ollama/  the Ollama 0.5.4 server inside the PyPI wheel bigdl-core-cpp, with its SYCL library
#            replaced by tests/backends/sycl_stub.c so that it runs on the CPU (+ gguf + numpy)
# Usage: bash tests/backends/install.sh [llama] [ollama]   (no argument: both)
# Idempotent: a part whose marker file holds the current version is skipped in well under a second.
# The first llama install compiles llama.cpp (9-20 minutes on 2 cores); pip caches the built wheel,
# so later installs on the same machine take seconds. Needs python3 (with venv and pip) and gcc.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="${IOP_BACKENDS_DIR:-$HOME/.cache/iop-backends}"
python="${IOP_BACKENDS_PYTHON:-python3}"

# Keep in step with servers.py (LLAMA_VERSION, OLLAMA_VERSION): it reads the same marker files.
llama_pins=("llama-cpp-python[server]==0.3.36" "gguf==0.19.0" "numpy==2.4.6")
ollama_pins=("bigdl-core-cpp==2.6.0" "intel-cmplr-lib-rt==2025.0.2" "intel-openmp==2025.0.2")
model_pins=("gguf==0.19.0" "numpy==2.4.6")
marker=".iop-backend"

say() { printf 'backends: %s\n' "$*"; }

# Run a command with its output in a log file; show the end of the log only if it fails.
quiet() {
    local log="$1"
    shift
    if ! "$@" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        say "FAILED: $* (full log: $log)" >&2
        return 1
    fi
}

new_venv() {
    local dir="$1"
    rm -rf "$dir"
    mkdir -p "$(dirname "$dir")"
    "$python" -m venv "$dir"
}

install_llama() {
    local dir="$root/llama" version
    version="llama $(printf '%s ' "${llama_pins[@]}")"
    if [ "$(cat "$dir/$marker" 2>/dev/null)" = "$version" ] &&
        "$dir/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '0.3.36')" 2>/dev/null; then
        say "llama: ready in $dir"
        return
    fi
    say "llama: installing ${llama_pins[*]} into $dir (compiles llama.cpp unless pip has the wheel cached: up to 20 min)"
    local start=$SECONDS
    new_venv "$dir"
    CMAKE_BUILD_PARALLEL_LEVEL=2 \
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
        quiet "$dir/pip.log" "$dir/bin/pip" install --disable-pip-version-check "${llama_pins[@]}"
    "$dir/bin/python" -c "import llama_cpp, llama_cpp.server, gguf, numpy"
    printf '%s\n' "$version" >"$dir/$marker"
    say "llama: installed in $((SECONDS - start)) s"
}

install_ollama() {
    local dir="$root/ollama" version stub_hash libs
    stub_hash="$(sha256sum "$here/sycl_stub.c" | cut -c1-16)"
    version="ollama $(printf '%s ' "${ollama_pins[@]}" "${model_pins[@]}")stub=$stub_hash"
    if [ "$(cat "$dir/$marker" 2>/dev/null)" = "$version" ]; then
        say "ollama: ready in $dir"
        return
    fi
    say "ollama: installing ${ollama_pins[*]} into $dir (about 20 s, 340 MB)"
    local start=$SECONDS
    new_venv "$dir"
    quiet "$dir/pip.log" "$dir/bin/pip" install --disable-pip-version-check --no-deps "${ollama_pins[@]}"
    quiet "$dir/pip-model.log" "$dir/bin/pip" install --disable-pip-version-check "${model_pins[@]}"
    libs="$("$dir/bin/python" -c "import bigdl.cpp, os; print(os.path.join(os.path.dirname(bigdl.cpp.__file__), 'libs'))")"
    say "ollama: replacing $libs/libollama-ggml-sycl.so with the CPU-only stub built from sycl_stub.c"
    gcc -shared -fPIC -O2 -Wall -Wextra -Werror -Wl,-soname,libollama-ggml-sycl.so \
        -o "$libs/libollama-ggml-sycl.so.stub" "$here/sycl_stub.c"
    mv -f "$libs/libollama-ggml-sycl.so.stub" "$libs/libollama-ggml-sycl.so"
    # The Intel runtime libraries (libsvml, libimf, libiomp5, ...) sit in the venv's lib/.
    if ! LD_LIBRARY_PATH="$dir/lib" "$libs/ollama-lib" --version >"$dir/version.log" 2>&1; then
        cat "$dir/version.log" >&2
        say "FAILED: $libs/ollama-lib --version" >&2
        return 1
    fi
    printf '%s\n' "$version" >"$dir/$marker"
    say "ollama: installed in $((SECONDS - start)) s ($(grep -o 'version is .*' "$dir/version.log"))"
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(llama ollama)
for part in "${parts[@]}"; do
    case "$part" in
    llama) install_llama ;;
    ollama) install_ollama ;;
    *)
        echo "usage: $0 [llama] [ollama]" >&2
        exit 2
        ;;
    esac
done
