"""Planning: everything that turns measured link rates into a policy, or judges one.

FAPT (``fapt``), the LP tree packing (``packing``, ``rootpacking``), auxiliary paths (``auxpath``),
planned offload (``offload``), the baselines (``baselines``), the fluid-model prediction (``predict``),
the min-cut limit (``limit``), all over the rate graph
(``rategraph``), and ``plan.plan``, which puts them together. The tier inside a DC has its own:
``lanmodel`` (trees to the gateway and their fluid model), ``aleph``, ``pahina``, ``eina`` (with
``milp``), ``dcplan`` (``plan_dc`` and the baselines) and ``dcreport``. The policy itself, data with its wire
form, is ``netstorm.policy``.

Nothing is imported here: the solvers behind most of these modules (HiGHS, scipy, networkx, numba) take
a while to load, and a general node, which only allots chunks to roots (``netstorm.allot``), must not
load them at all: nothing outside this package, the scheduler and the top layer imports it
(tests/test_layers.py). The names of the planners are registries below it (``netstorm.topologies``,
``netstorm.dcplanners``). Import the module you need.
"""
