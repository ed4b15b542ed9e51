"""The memory guard's family (M1-M26, S1-S10): the view of the box (`memview.py`), its values and the
0.01 grid (`memstate.py`), squeezes and lowerings (`memsqueeze.py`), a change followed
(`memfollow.py`), raises back (`memrestore.py`), the verdict and its lines (`memguard.py`), the start
guard (`startguard.py`), a unit's wiring for it (`wiring.py`), and the tick's step for all of it
(`memstep.py`)."""
