"""The pure core: vocabulary, observations, rules and the tick's decision. No I/O, no clock,
no sleeping; imports nothing from guardian.observe, guardian.act or the shell above them.

A map, to read first. One tick is `tick.decide(state, observation, now, cfg) -> (state, actions)`;
its numbered steps name the modules below in the order they run.

- The values: `vocab.py` (states, decisions, gates), `observations.py` (what the observers hand in),
  `actions.py` (what the shell is asked to do), `rules.py` (a rule, a row, first match), `work.py`
  (one tick in the making).
- The watchdog, `watchdog/`: each replica's verdict from its probes, counters, canaries and
  processes (`liveness.py` is the table, L1-L22; `canary.py` C1-C5), turned into restarts by
  `restarts.py` through admission (`admission.py`, A*) and the unit gates (`gates.py`, G*).
- The proxy, `proxy/`: a planned restart drained first (`drain.py` D*, `draining.py` its steps),
  and clients that bypass the proxy (`bypass.py`, B*).
- The memory guard, `memory/`: the view of the box (`memview.py`), squeezes and lowerings
  (`memsqueeze.py`, `memguard.py`, M*), raises back (`memrestore.py`), following a change
  (`memfollow.py`), the start guard (`startguard.py`, S*), a unit's wiring for it (`wiring.py`);
  `memstep.py` is the tick's step for all of it.
- A start that fits, `fit/`: the verdict (`startfit.py`, U*) and what it says (`fitsay.py`).
- What is said once when it begins and ends (`notices.py`: hazards, weights, a host's split, the
  engine), a start loop (`startloop.py`, A6), a planned stop's bound (`stopping.py`, T*), hazards
  (`hazards.py`, `outside.py`, H*), weights (`weights.py`, W*), the fleet (`fleet.py`, F*),
  operators' requests (`requests.py`), containers (`container.py`), and the limits in effect as
  text (`thresholds.py`).

docs/layout.md has every module in one line; docs/rules.md every rule, rendered from the tables.
"""
