#!/usr/bin/env python3
"""The mutation test of cudasim's streams (docs/cuda.md, "What the stream tests cover").

Every cudaStreamWaitEvent the GPU engines make is needed: without it a consumer may run before
its producer on a GPU. This test proves the CUDA tests notice each one missing. It runs a few
scenarios (real engine paths: activation offload, ZeRO-Offload, DDP's overlapped all-reduces,
ZeRO-3's gathered units, the GPU pipeline) on cudasim and lists the call sites of their event
waits (MEMTRAIN_SIM_WAIT_SITES); then, for each call site, reruns the scenarios that reach it
with that site's waits dropped (MEMTRAIN_SIM_DROP_WAIT=site:OFFSET) under the interleaving seeds
until one fails. It passes when every site is caught, and prints which scenario and seed caught
each, by source line (the backend's host code carries line tables: -g1).

    drop_wait_test.py BUILD_DIR [--mpiexec MPIEXEC] [--only SCENARIO,...] [--list]
"""
import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

SEEDS = (1, 2, 3)

# name -> (binary, gtest filter, ranks (0: no mpirun)). Each is a handful of short training runs
# whose results the tests compare against a reference, so a stale read fails an assertion.
SCENARIOS = {
    'remat_offload': ('memtrain_sim_tests', 'CudaTrain.EveryRematPolicyTrainsTheSameModel', 0),
    'zero_offload': ('memtrain_sim_tests', 'CudaTrain.OffloadedOptimizerTrainsTheSameModel', 0),
    'zero_np2': ('memtrain_sim_dist_tests', 'CudaDp.RanksTrainTheSameModelAsOneProcess', 2),
    'zero3_slots_np2': ('memtrain_sim_dist_tests', 'CudaDp.Zero3RotatesUnitsThroughItsSlots', 2),
    'offload_np2': ('memtrain_sim_dist_tests',
                    'CudaDp.Zero2WithOffloadedActivations:CudaDp.OffloadedShardsTrainTheSameModel', 2),
    'pipeline_np2': ('memtrain_sim_dist_tests',
                     'CudaPp.MatchesTheCpuRun:CudaPp.Fp16LossScalingAgreesAcrossStages', 2),
}


def command(build, mpiexec, scenario, fail_fast=False):
    binary, gfilter, ranks = SCENARIOS[scenario]
    argv = [os.path.join(build, binary), '--gtest_filter=' + gfilter]
    # A mutant is caught at its first failed assertion: one process stops there (under mpirun
    # the other ranks would wait for it in a collective until the communication timeout).
    if fail_fast and not ranks:
        argv.append('--gtest_fail_fast')
    if ranks:
        argv = [mpiexec, '--oversubscribe', '--allow-run-as-root', '-np', str(ranks)] + argv
    return argv


def run(build, mpiexec, scenario, env_extra, timeout, fail_fast=False):
    env = dict(os.environ, OMP_NUM_THREADS='1', MEMTRAIN_COMM_TIMEOUT_S='30',
               ASAN_OPTIONS='detect_leaks=0', **env_extra)
    t0 = time.time()
    try:
        p = subprocess.run(command(build, mpiexec, scenario, fail_fast), env=env,
                           stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout, text=True, errors='replace')
        return p.returncode, p.stdout, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b'').decode(errors='replace')
        return 'timeout', out, time.time() - t0


def symbolize(module, offset):
    """The inline chain of source lines at the call, innermost first ("file:line" each)."""
    if not shutil.which('addr2line'):
        return ['%s+%#x' % (os.path.basename(module), offset)]
    p = subprocess.run(['addr2line', '-i', '-f', '-C', '-e', module, '%#x' % (offset - 1)],
                       stdout=subprocess.PIPE, text=True)
    lines = p.stdout.splitlines()
    chain = []
    for fn, loc in zip(lines[0::2], lines[1::2]):
        loc = loc.split(' (discriminator')[0]
        if '/src/' not in loc and chain:
            break  # the call chain leaves memtrain (std::function and the like)
        if loc.startswith('??'):
            loc = '%s+%#x' % (os.path.basename(module), offset)
        src = loc.find('/src/')
        chain.append((loc[src + 1:] if src >= 0 else loc, fn))
    return chain or [('%s+%#x' % (os.path.basename(module), offset), '?')]


def short_function(fn):
    """'memtrain::(anonymous namespace)::CudaPipelineEngine<float>::join_sends()' ->
    'CudaPipelineEngine::join_sends'."""
    fn = fn.replace('(anonymous namespace)::', '').split('(')[0]
    depth, out = 0, ''
    for ch in fn:  # drop template arguments
        if ch == '<':
            depth += 1
        elif ch == '>':
            depth -= 1
        elif depth == 0:
            out += ch
    parts = [p for p in out.split('::') if p and not p.startswith('{') and p != 'memtrain'
             and 'anonymous' not in p]
    return '::'.join(parts[-2:])


def source_text(root, loc):
    """The source line at 'src/file.cpp:N', stripped."""
    path, _, line = loc.rpartition(':')
    try:
        with open(os.path.join(root, path)) as f:
            return f.read().splitlines()[int(line) - 1].strip()
    except (OSError, ValueError, IndexError):
        return ''


# Waits no test can miss because another wait, or the protocol, already orders what they order:
# (a fragment of the wait's source line, the functions its call is inlined into, outermost last,
# why). drop_wait_test.py does not rerun them (--check-redundant does); a wait the tests miss
# that is not listed here fails the test.
REDUNDANT = [
    ('for (cudaEvent_t e : out_sent_)', 'run_schedule <- forward_backward',
     "the next step's forward waits for its slot's own send (out_sent_[slot]) before rewriting "
     "the slot, and an arena carved anew is freed first (cudaFree waits for the device)"),
    ('grad_sent_, 0)', 'run_schedule <- forward_backward',
     "the next step's backward waits for the gradient buffer's last send (grad_sent_) before "
     "rewriting it, and an arena carved anew is freed first"),
    ('grad_sent_, 0)', 'forward_loss',
     "an evaluation sends no gradient, and the last training step's gradient send was joined "
     "at the end of its schedule"),
    ('out_sent_[slot], 0)', '',
     "in training a slot is reused only after its micro-batch's backward, whose gradient the "
     "next stage sends only after receiving this slot's output; an evaluation joins its sends "
     "and waits before the next forward"),
]


def callers(chain):
    """The functions the wait's call is inlined into, as addr2line names them ('' if none)."""
    return ' <- '.join(short_function(fn).split('::')[-1] for _, fn in chain[1:])


def redundant(chain, text):
    for fragment, inlined_into, why in REDUNDANT:
        if fragment in text and callers(chain) == inlined_into:
            return why
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('build')
    ap.add_argument('--mpiexec', default=shutil.which('mpiexec') or 'mpiexec')
    ap.add_argument('--only', default='', help='comma-separated scenarios')
    ap.add_argument('--list', action='store_true', help='list the wait sites and stop')
    ap.add_argument('--timeout', type=float, default=0,
                    help='seconds per run (default: 5x the scenario as it passes, at least 60)')
    ap.add_argument('--check-redundant', action='store_true',
                    help='also drop the waits listed as redundant (REDUNDANT)')
    args = ap.parse_args()
    scenarios = [s for s in (args.only.split(',') if args.only else SCENARIOS)]
    for s in scenarios:
        if s not in SCENARIOS:
            sys.exit('drop_wait_test: unknown scenario %s (%s)' % (s, ', '.join(SCENARIOS)))

    # 1. Every scenario passes as it is, and says where its waits are.
    sites = collections.defaultdict(set)  # (module, offset) -> scenarios reaching it
    calls = collections.Counter()
    took = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in scenarios:
            d = os.path.join(tmp, s)
            os.mkdir(d)
            rc, out, secs = run(args.build, args.mpiexec, s, {'MEMTRAIN_SIM_WAIT_SITES': d},
                                args.timeout or 600)
            took[s] = secs
            print('scenario %-14s %s in %.0f s' % (s, 'passes' if rc == 0 else 'FAILS', secs))
            if rc != 0 or '[  PASSED  ]' not in out:
                print(out[-4000:])
                sys.exit('drop_wait_test: scenario %s fails with every wait in place' % s)
            if '0 tests' in out.split('[  PASSED  ]')[-1].split('\n')[0]:
                sys.exit('drop_wait_test: scenario %s matches no test' % s)
            for name in os.listdir(d):
                for line in open(os.path.join(d, name)):
                    module, offset, n = line.rstrip('\n').split('\t')
                    sites[(module, int(offset, 16))].add(s)
                    calls[(module, int(offset, 16))] += int(n)
    if not sites:
        sys.exit('drop_wait_test: the scenarios made no event waits')

    # 2. Each site's waits dropped: some scenario reaching it must fail, under some seed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    by_line = collections.defaultdict(list)  # source chain -> [(module, offset)]
    why_redundant = {}
    for key in sites:
        chain = symbolize(*key)
        line = ' <- '.join(loc for loc, _ in chain)
        text = source_text(root, chain[0][0])
        line = '%s  [%s%s]' % (line, text, ' in ' + callers(chain) if len(chain) > 1 else '')
        by_line[line].append(key)
        why = redundant(chain, text)
        if why:
            why_redundant[line] = why
    print('\n%d call sites of cudaStreamWaitEvent (%d source lines) reached by %s' %
          (len(sites), len(by_line), ', '.join(scenarios)))
    if args.list:
        for line, keys in sorted(by_line.items()):
            print('  %s: %d calls, in %s; %s' % (
                line, sum(calls[k] for k in keys),
                ', '.join(sorted(set().union(*(sites[k] for k in keys)))),
                ' '.join('%s:site:%#x' % (os.path.basename(m), o) for m, o in sorted(keys))))
        return 0
    missed = []
    for line, keys in sorted(by_line.items()):
        if line in why_redundant and not args.check_redundant:
            print('  redundant  %s\n          %s' % (line, why_redundant[line]))
            continue
        caught = None
        t0, runs = time.time(), 0
        # The quickest scenario first; each under the seeds in turn until one fails.
        tries = sorted((took[s], s, key) for key in keys for s in sites[key]
                       if SCENARIOS[s][0] == os.path.basename(key[0]))
        for seed in SEEDS:
            for _, s, key in tries:
                runs += 1
                rc, out, secs = run(args.build, args.mpiexec, s,
                                    {'MEMTRAIN_SIM_DROP_WAIT': 'site:%#x' % key[1],
                                     'MEMTRAIN_SIM_SEED': str(seed)},
                                    args.timeout or max(60, 5 * took[s]), fail_fast=True)
                if rc != 0:
                    caught = (s, seed, rc)
                    break
            if caught:
                break
        if caught:
            how = 'timed out' if caught[2] == 'timeout' else 'failed'
            print('  caught  %s\n          %s %s under seed %d (%d runs, %.0f s)' %
                  (line, caught[0], how, caught[1], runs, time.time() - t0))
        elif line in why_redundant:
            print('  redundant  %s (no scenario fails without it, as listed)' % line)
        else:
            print('  MISSED  %s (no scenario fails without it; if another wait or the protocol '
                  'already orders what it orders, list it in REDUNDANT with why)' % line)
            missed.append(line)
    if missed:
        print('\ndrop_wait_test: %d of %d waits can be removed without a failing test' %
              (len(missed), len(by_line)))
        return 1
    print('\ndrop_wait_test: every one of the %d waits is needed by a test (%d listed as '
          'redundant)' % (len(by_line) - len(why_redundant), len(why_redundant)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
