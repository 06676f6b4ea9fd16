"""The package's layers: no import cycle, no import running upward, no library file over 450 lines.

Pure `ast` over the source (nothing of the package is imported, so no jax), module-level and
function-local imports alike. The layers, bottom to top (a module may import its own layer and
the layers below; the first prefix that matches a module, longest first, gives its layer):

  foundation     errors, progress, cpu_info, hostmem: no project imports but each other
  core           config_lib, config_migrate, sharding, checkpointing, decoding, evaluation,
                 java_scorers, token_ids
                 (the caption vocabulary's special-token ids, which models need)
  procedure      procedure/ (frames between the pair, confidence scores, keyframe sampling)
  models         models/, and the stand-in batches and tokenizer of diagnostics/stand_ins
  data           data/ (vocabulary, BPE, images, datasets, the grain pipeline, and the feature
                 cache, which encodes every frame once with the frozen tokenizer of models/)
  builders       tfds_builders/ (the TFDS builders; they read data/ and procedure/)
  scores         semantic_scores (the synthetic benchmark's grammar read back; evaluation),
                 ablation_table (the ablation table and goal lines from finished runs' results),
                 ablation_plot (the same as a picture), ablation_clock (the table's wall time
                 over the calls that made it)
  blocks         convert/ (weights of the original in), train (the one training loop), train_log
  tasks          tasks/ (what differs per stage)
  configs        configs/ (one get_config per dataset x stage)
  entry points   main, stages, caption, report, ablations, convert/__main__,
                 procedure/visualize, serve and demo/ (commands a user runs)
  tools          diagnostics/ (analysis commands on a run's workdir)

A function-local import of a project module is allowed only with a reason on its line,
`# lazy: <why>` (start-up time of a command measured to need it); it counts as an edge too.
"""

import ast
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ('procap_jax', 'tfds_builders', 'configs')
MAX_LINES = 450

LAYERS = (
    ('foundation', ('procap_jax.errors', 'procap_jax.progress', 'procap_jax.cpu_info',
                    'procap_jax.hostmem')),
    ('core', ('procap_jax.config_lib', 'procap_jax.config_migrate', 'procap_jax.sharding',
              'procap_jax.checkpointing', 'procap_jax.decoding', 'procap_jax.evaluation',
              'procap_jax.java_scorers', 'procap_jax.token_ids')),
    ('procedure', ('procap_jax.procedure',)),
    ('models', ('procap_jax.models', 'procap_jax.diagnostics.stand_ins')),
    ('data', ('procap_jax.data',)),
    ('builders', ('tfds_builders.',)),
    ('scores', ('procap_jax.semantic_scores', 'procap_jax.ablation_table',
                'procap_jax.ablation_plot', 'procap_jax.ablation_clock')),
    ('blocks', ('procap_jax.convert', 'procap_jax.train', 'procap_jax.train_log')),
    ('tasks', ('procap_jax.tasks',)),
    ('configs', ('configs.',)),
    ('entry points', ('procap_jax.main', 'procap_jax.stages', 'procap_jax.caption',
                      'procap_jax.report', 'procap_jax.ablations', 'procap_jax.convert.__main__',
                      'procap_jax.procedure.visualize', 'procap_jax.serve', 'procap_jax.demo')),
    ('tools', ('procap_jax.diagnostics',)),
)


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
  """Dotted module name -> (file, is a package's __init__)."""
  out = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob('*.py')):
      parts = list(path.relative_to(ROOT).with_suffix('').parts)
      is_package = parts[-1] == '__init__'
      out['.'.join(parts[:-1] if is_package else parts)] = (path, is_package)
  return out


def layer_of(module: str) -> int:
  """Index in LAYERS of the longest name matching `module`: 'a.b' matches a.b and a.b.*, 'a.'
  matches a.* only. The packages' own __init__ files are at the bottom."""
  if module in PACKAGES:
    return 0
  best, rank = -1, None
  for i, (_, names) in enumerate(LAYERS):
    for p in names:
      hit = module.startswith(p) if p.endswith('.') else (
          module == p or module.startswith(p + '.'))
      if hit and len(p) > best:
        best, rank = len(p), i
  assert rank is not None, f'{module} is in no layer; add it to LAYERS'
  return rank


def _targets(module: str, is_package: bool, node: ast.AST, modules) -> list[str]:
  """The project modules an import statement loads (the module itself excluded)."""
  names = []
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  else:
    if node.level:
      base = module.split('.')[:len(module.split('.')) - (node.level - 1) - (not is_package)]
      stem = '.'.join(base + ([node.module] if node.module else []))
    else:
      stem = node.module
    names = [f'{stem}.{a.name}' if f'{stem}.{a.name}' in modules else stem for a in node.names]
  out = []
  for name in names:
    while name and name not in modules:
      name = name.rpartition('.')[0]
    if name and name != module:
      out.append(name)
  return out


def _imports():
  """[(importer, imported, line number, function-local, source line)] over the packages."""
  modules = _modules()
  edges = []
  for module, (path, is_package) in modules.items():
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        for target in _targets(module, is_package, node, modules):
          edges.append((module, target, node.lineno, id(node) in local, lines[node.lineno - 1]))
  return modules, edges


def test_every_module_has_a_layer():
  modules, _ = _imports()
  for module in modules:
    layer_of(module)


def test_no_import_runs_upward():
  _, edges = _imports()
  upward = [f'{a} (layer {LAYERS[layer_of(a)][0]}) imports {b} (layer {LAYERS[layer_of(b)][0]}) '
            f'at line {line}' for a, b, line, _, _ in edges if layer_of(b) > layer_of(a)]
  assert not upward, 'imports that run upward:\n' + '\n'.join(upward)


def test_no_import_cycle():
  _, edges = _imports()
  graph = collections.defaultdict(set)
  where = {}
  for a, b, line, _, _ in edges:
    graph[a].add(b)
    where.setdefault((a, b), line)
  # Depth-first search; a back edge closes a cycle, named with every import on it.
  state, stack, cycles = {}, [], []

  def visit(v):
    state[v] = 'open'
    stack.append(v)
    for w in sorted(graph[v]):
      if state.get(w) == 'open':
        ring = stack[stack.index(w):] + [w]
        cycles.append(' -> '.join(f'{x} (line {where[(x, y)]})' for x, y in zip(ring, ring[1:])))
      elif w not in state:
        visit(w)
    stack.pop()
    state[v] = 'done'

  for v in sorted(graph):
    if v not in state:
      visit(v)
  assert not cycles, 'import cycles:\n' + '\n'.join(cycles)


def test_function_local_imports_give_a_reason():
  _, edges = _imports()
  silent = [f'{a} imports {b} inside a function at line {line} without "# lazy: <why>"'
            for a, b, line, local, source in edges if local and '# lazy:' not in source]
  assert not silent, '\n'.join(silent)


def test_no_library_file_over_max_lines():
  long = [f'{path.relative_to(ROOT)}: {n} lines' for path, _ in _modules().values()
          if (n := len(path.read_text().splitlines())) > MAX_LINES]
  assert not long, f'files over {MAX_LINES} lines (split them at a seam):\n' + '\n'.join(long)


def test_layer_walk_sees_an_upward_import_and_a_cycle(tmp_path):
  """The checks can fail: a planted upward import and cycle are found by the same code."""
  modules = {'procap_jax.errors': None, 'procap_jax.tasks.x': None, 'procap_jax.models.y': None}
  node = ast.parse('from procap_jax.tasks import x').body[0]
  (target,) = _targets('procap_jax.models.y', False, node, modules)
  assert target == 'procap_jax.tasks.x'
  assert layer_of(target) > layer_of('procap_jax.models.y')
  relative = ast.parse('from ..tasks import x').body[0]
  assert _targets('procap_jax.models.y', False, relative, modules) == ['procap_jax.tasks.x']


# ---------------------------------------------------------------- the config is the schema
CONFIG_ROOTS = re.compile(r'^(config|cfg|\w+_config)$')


def _config_chain_root(node: ast.AST) -> str | None:
  """The name at the root of `a.b[c].d` (attributes and subscripts only), else None."""
  while isinstance(node, (ast.Attribute, ast.Subscript)):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def config_get_calls(source: str) -> list[tuple[int, str]]:
  """(line, call) of every `.get(` on a config node in `source`: on a name like `config`/`cfg`
  or an attribute/subscript chain from one, or on a local name bound to such a chain
  (`t = config.pretrain.train; t.get(...)`)."""
  tree = ast.parse(source)
  found = []
  scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Module))]
  for scope in scopes:
    nodes = ([n for stmt in scope.body for n in ast.walk(stmt)] if isinstance(scope, ast.Module)
             else list(ast.walk(scope)))
    bound = set()
    for n in sorted((n for n in nodes if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
      root = _config_chain_root(n.value)
      if root is not None and (CONFIG_ROOTS.match(root) or root in bound):
        bound.update(t.id for t in n.targets if isinstance(t, ast.Name))
    for n in nodes:
      if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == 'get'):
        root = _config_chain_root(n.func.value)
        if root is not None and (CONFIG_ROOTS.match(root) or root in bound):
          found.append((n.lineno, ast.unparse(n)))
  return sorted(set(found))


def test_library_code_reads_config_keys_without_get_fallbacks():
  """The config is the schema (conventions 5): library code reads `config.a.b`, never
  `config.a.get('b', default)`; old runs' configs are filled by `config_lib.migrate`."""
  calls = [f'{path.relative_to(ROOT)}:{line}: {call}'
           for package in ('procap_jax', 'tfds_builders')
           for path in sorted((ROOT / package).rglob('*.py'))
           for line, call in config_get_calls(path.read_text())]
  assert not calls, 'config.get( in library code (read the key; migrate old configs):\n' + \
      '\n'.join(calls)


def test_config_get_check_sees_direct_and_bound_calls():
  """The check can fail: each planted form is found, a dict's .get is not."""
  source = ('def f(config, stage, results):\n'
            '  a = config.caption.decoding.get("encode_rows", 0)\n'
            '  tr = config[stage].train\n'
            '  t = tr\n'
            '  b = t.get("micro_batches", 1)\n'
            '  c = results.get("split")\n'
            '  d = json.loads(config.to_json()).get("x")\n'
            '  return model_config.get("k")\n')
  assert [line for line, _ in config_get_calls(source)] == [2, 5, 8]
