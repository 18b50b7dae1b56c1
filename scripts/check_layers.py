#!/usr/bin/env python3
"""The layering check: every #include "..." under src/ points to the file's own folder or to a
folder of a lower layer, in the order written in docs/architecture.md (the fenced block marked
`layers`, highest first); no two sub-folders include each other in a cycle. Exits 1 naming each
include that breaks a rule. Run by `make test` (CTest entry `layering`)."""
import os
import re
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if len(sys.argv) == 3 and sys.argv[1] == '--root':  # another checkout (the check's own test)
    root = os.path.abspath(sys.argv[2])
doc = open(os.path.join(root, 'docs', 'architecture.md'), encoding='utf-8').read()
block = re.search(r'```text layers\n(.*?)```', doc, re.S)
if not block:
    sys.exit('check_layers: docs/architecture.md has no ```text layers block')
rows = [line.split('#')[0].split() for line in block.group(1).splitlines()]
rows = [r for r in rows if r]
layer = {}  # top folder -> height (0 = lowest)
for height, folders in enumerate(reversed(rows)):
    for f in folders:
        layer[f] = height

src = os.path.join(root, 'src')
include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
problems = []
edges = {}  # sub-folder -> set of sub-folders it includes
for dirpath, _, files in os.walk(src):
    for name in sorted(files):
        if not name.endswith(('.h', '.cpp', '.cu', '.cuh')):
            continue
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, src)
        parts = rel.split(os.sep)
        if len(parts) == 1:
            problems.append(f'src/{rel}: a file outside every folder')
            continue
        top = parts[0]
        if top not in layer:
            problems.append(f'src/{rel}: folder {top}/ is not in the layer table')
            continue
        text = open(path, encoding='utf-8').read()
        for m in include.finditer(text):
            target = m.group(1)
            if not os.path.exists(os.path.join(src, target)):
                continue  # a file of the same folder by its bare name, or a generated header
            tparts = target.split('/')
            ttop = tparts[0]
            line = text.count('\n', 0, m.start()) + 1
            if ttop not in layer:
                problems.append(f'src/{rel}:{line}: includes {target}, whose folder is not in the table')
                continue
            if ttop != top and layer[ttop] >= layer[top]:
                how = 'the same layer' if layer[ttop] == layer[top] else 'a higher layer'
                problems.append(f'src/{rel}:{line}: {top}/ includes {target} from {how}')
            a = '/'.join(parts[:-1][:2])
            b = '/'.join(tparts[:-1][:2])
            if a != b:
                edges.setdefault(a, set()).add(b)

# Cycles between sub-folders (engine/cpu <-> engine/cuda, model <-> model/...): Tarjan's SCC.
index, low, stack, on, out = {}, {}, [], set(), []
def strong(v):
    index[v] = low[v] = len(index)
    stack.append(v); on.add(v)
    for w in edges.get(v, ()):
        if w not in index:
            strong(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            out.append(sorted(comp))
sys.setrecursionlimit(10000)
for v in list(edges):
    if v not in index:
        strong(v)
for comp in out:
    problems.append('include cycle between folders: ' + ' <-> '.join(comp))

for p in problems:
    print(p)
if problems:
    print(f'check_layers: {len(problems)} problem(s); the order is in docs/architecture.md')
    sys.exit(1)
print(f'check_layers: {len(layer)} folders on {len(rows)} layers, no include points up, no cycle')
