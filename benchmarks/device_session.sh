#!/usr/bin/env bash
# One call on a GPU machine that reaches no package registry: install kvcore there, then run the phases named,
# in order, each with its output kept under $OUT (default /tmp/kvcore-out) and its last lines printed.
#
#   bash benchmarks/device_session.sh [tests] [alloc] [probe] [bench] [quick] [fp4] [check] [transfer] [hfgen] [unified] [minimax] [hisparse] [dsv4] [sparse] [hfcore] [tune] [hfprof] [fp8k] [split] [fp8probe] [hfstep] [split1] [hfparts] [launchafter] [amid] [sdpa] [copies] [sgdev]
#
#   tests  the compiled suite: KVCORE_TEST_COMPILED=1 python -m pytest -q -n 12   ($OUT/tests.txt)
#   alloc  python benchmarks/bench_allocator.py                                     ($OUT/alloc.txt)
#   probe  python benchmarks/probe_alloc_step.py                                    ($OUT/probe.txt)
#   bench  kvcore bench (host-cost and graph-replay tables of every family)          ($OUT/bench.txt)
#   quick  kvcore bench --quick                                                      ($OUT/quick.txt)
#   fp4    python benchmarks/bench_fp4.py                                            ($OUT/fp4.txt)
#   check  kvcore check acme --device cuda (the example vendor package)              ($OUT/check.txt)
#   transfer  python benchmarks/bench_transfer.py (needs the nixl wheels under .whl)  ($OUT/transfer.txt)
#   hfgen  python benchmarks/bench_hf_generate.py $HFGEN_ARGS (transformers generation)  ($OUT/hfgen.txt)
#   unified  python benchmarks/bench_unified_device.py (the unified memory's costs)   ($OUT/unified.txt)
#   minimax  kvcore bench --quick of the MiniMax sparse family (and MHA's, the engine step) ($OUT/minimax.txt)
#   hisparse  python benchmarks/bench_hisparse_device.py (HiSparse's host <-> device gathers)  ($OUT/hisparse.txt)
#   dsv4   the DeepSeek-V4 family's tests, compiled                                   ($OUT/dsv4.txt)
#   sparse  kvcore bench of the DeepSeek-V4 and MiniMax sparse families, every size (32k tokens included)  ($OUT/sparse.txt)
#   hfcore  the head gathers', the transformers cache's and the layout guard's tests, compiled         ($OUT/hfcore.txt)
#   copies  every deep-copy test (pools, allocators, the transformers cache), compiled              ($OUT/copies.txt)
#   tune   python benchmarks/tune_row_stores.py (the 128-value quantizing stores)    ($OUT/tune.txt)
#   hfprof  python benchmarks/profile_hf_generate.py (where a generation step goes)  ($OUT/hfprof.txt)
#   fp8k   the fp8 encoders' tests and the stores' and gathers' that use them, compiled  ($OUT/fp8k.txt)
#   split  torchrun --nproc-per-node 2 benchmarks/bench_layer_split.py (DSA's layer split; needs 2 GPUs)  ($OUT/split.txt)
#   fp8probe  python benchmarks/probe_fp8_rows.py (where the fp8 row store's time goes)  ($OUT/fp8probe.txt)
#   hfstep  python benchmarks/probe_hf_step.py (a decode step's host time by function, DynamicCache vs kvcore)  ($OUT/hfstep.txt)
#   split1  the same as split with both ranks on one GPU (gloo): its reads and stores timed, the fetch through the host  ($OUT/split1.txt)
#   hfparts  python benchmarks/probe_hf_parts.py $HFPARTS_ARGS (a lockstep decode step split into the cache's, attention's, the layers' and generate's parts)  ($OUT/hfparts.txt)
#   launchafter  python benchmarks/probe_launch_after.py at 1 x 100 and 8 x 4000 tokens (the host work after a launch)  ($OUT/launchafter*.txt)
#   amid   python benchmarks/probe_launch_amid.py at 1 x 100 and 8 x 4000 tokens (one update's host cost after a layer's work)  ($OUT/amid*.txt)
#   sdpa   python benchmarks/probe_sdpa_inputs.py $SDPA_ARGS (the first SDPA call whose inputs or output differ between caches)  ($OUT/sdpa.txt)
#   sgdev  python benchmarks/probe_store_gather_device.py $SGDEV_ARGS (a decode step's store-and-gather against its torch path, torch.cat and the copy ceiling)  ($OUT/sgdev.txt)
#
# That machine lacks omegaconf: put its wheel under .whl first (ignored by git) and carry .whl with the call:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl omegaconf==2.4.0
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvcore-out}
mkdir -p "$OUT"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_session: no wheels under .whl (see the header)"; exit 2; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . -e examples/vendor-plugin -e examples/second-vendor-plugin \
    >"$OUT/install.txt" 2>&1 || { tail -20 "$OUT/install.txt"; exit 2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

status=0
run() {  # run NAME COMMAND...: output to $OUT/NAME.txt, its tail printed, a failure remembered
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.txt"
    echo "== $name: rc $rc, $((SECONDS - start)) s"
    [ $rc -eq 0 ] || status=1
}

for phase in "$@"; do
    case $phase in
        tests) run tests env KVCORE_TEST_COMPILED=1 python3 -m pytest -q -n 12 -p no:cacheprovider ;;
        alloc) run alloc python3 benchmarks/bench_allocator.py ;;
        probe) run probe python3 benchmarks/probe_alloc_step.py ;;
        bench) run bench python3 -m kvcore bench ;;
        quick) run quick python3 -m kvcore bench --quick ;;
        fp4) run fp4 python3 benchmarks/bench_fp4.py ;;
        check) run check python3 -m kvcore check acme --device cuda ;;
        transfer) run transfer python3 benchmarks/bench_transfer.py ;;
        hfgen) run hfgen python3 benchmarks/bench_hf_generate.py ${HFGEN_ARGS:-} ;;
        unified) run unified python3 benchmarks/bench_unified_device.py ;;
        minimax) run minimax env KVCORE_PLUGINS=mha,minimax_sparse python3 -m kvcore bench --quick ;;
        hisparse) run hisparse python3 benchmarks/bench_hisparse_device.py ;;
        dsv4) run dsv4 env KVCORE_TEST_COMPILED=1 python3 -m pytest -q -p no:cacheprovider plugins/dsv4 ;;
        sparse) run sparse env KVCORE_PLUGINS=mha,minimax_sparse,dsv4 python3 -m kvcore bench ;;
        hfcore) run hfcore env KVCORE_TEST_COMPILED=1 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_head_gather.py \
            tests/test_transformers_cache.py tests/test_launch_contract.py tests/test_tensor_guard.py \
            tests/test_resident_gather.py tests/test_transformers_resident_rows.py ;;
        copies) run copies env KVCORE_TEST_COMPILED=1 python3 -m pytest -q -p no:cacheprovider -n 8 \
            -k "deep_copy or copy_of_the_cache" tests plugins examples/vendor-plugin examples/second-vendor-plugin ;;
        tune) run tune python3 benchmarks/tune_row_stores.py ;;
        hfprof) run hfprof python3 benchmarks/profile_hf_generate.py ;;
        fp8k) run fp8k env KVCORE_TEST_COMPILED=1 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_fp8.py \
            plugins/mha/tests/test_kernels.py plugins/mha/tests/test_row_store.py plugins/mla/tests/test_kernels.py ;;
        split) run split python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_layer_split.py ;;
        fp8probe) run fp8probe python3 benchmarks/probe_fp8_rows.py ;;
        hfstep) run hfstep python3 benchmarks/probe_hf_step.py ;;
        split1) run split1 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_layer_split.py --one-gpu ;;
        hfparts) run hfparts python3 benchmarks/probe_hf_parts.py ${HFPARTS_ARGS:-} ;;
        launchafter) run launchafter1 python3 benchmarks/probe_launch_after.py --seq 100 --batch 1
                     run launchafter8 python3 benchmarks/probe_launch_after.py --seq 4000 --batch 8 ;;
        amid) run amid1 python3 benchmarks/probe_launch_amid.py --batch 1 --prompt 100
              run amid8 python3 benchmarks/probe_launch_amid.py --batch 8 --prompt 4000 ;;
        sdpa) run sdpa python3 benchmarks/probe_sdpa_inputs.py ${SDPA_ARGS:-float8_e4m3fn:8:8000} ;;
        sgdev) run sgdev python3 benchmarks/probe_store_gather_device.py --json "$OUT/sgdev.json" ${SGDEV_ARGS:-} ;;
        *) echo "device_session: unknown phase $phase (tests, alloc, probe, bench, quick, fp4, check, transfer, hfgen, unified, minimax, hisparse, dsv4, sparse, hfcore, tune, hfprof, fp8k, split, fp8probe, hfstep, split1, hfparts, launchafter, amid, sdpa, copies, sgdev)"; status=2 ;;
    esac
done
exit $status
