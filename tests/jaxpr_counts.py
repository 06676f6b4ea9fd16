"""Counting equations in a jaxpr, for tests that assert how much work a program holds."""


def count_equations(jaxpr, names: tuple[str, ...]) -> int:
  """Equations whose primitive is one of `names` in a jaxpr and in every jaxpr nested in its
  equations' parameters (a loop's body counts once)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in names
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          count += count_equations(inner, names)
  return count
