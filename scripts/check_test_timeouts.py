#!/usr/bin/env python3
"""Fails when a CTest entry of BUILD_DIR has no TIMEOUT property of its own (CTest's default
would then be 1500 s, or none): every test must end by itself, on any machine. Run by CTest
(entry ctest_timeouts)."""
import json
import subprocess
import sys

build = sys.argv[1] if len(sys.argv) > 1 else 'build'
out = subprocess.run(['ctest', '--test-dir', build, '--show-only=json-v1'], check=True,
                     stdout=subprocess.PIPE, text=True).stdout
tests = json.loads(out)['tests']
missing = [t['name'] for t in tests
           if not any(p['name'] == 'TIMEOUT' and float(p['value']) > 0
                      for p in t.get('properties', []))]
if missing:
    print('%d of %d CTest entries have no TIMEOUT: %s' % (len(missing), len(tests),
                                                         ', '.join(missing[:20])))
    sys.exit(1)
print('all %d CTest entries have a TIMEOUT' % len(tests))
