"""The suite runs llama.cpp on every core, beside whatever else the machine runs.

libgomp's threads spin 300,000 turns at each of the several hundred barriers of a decode before
they sleep. With another process on one of two cores, a decode then took 10-15 times as long
(bench/omp_wait.py), and a run of the suite beside a busy core was on its way past 90 minutes.
At 1,000 turns a decode beside a busy core is about 4 times as fast as with the default, and about
5% slower on an idle machine; outputs do not change. libgomp reads the setting once, when llama.cpp
loads it, so it is set here, before conftest imports llama.cpp; a value given outside wins.
"""

import os

os.environ.setdefault("GOMP_SPINCOUNT", "1000")
