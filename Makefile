# The two commands of the README. Both need root (they boot a container with systemd-nspawn).
.PHONY: demo test unit lint fuzz deb lock

demo:
	scripts/setup.sh
	.venv/bin/python demo/demo.py

test:
	scripts/setup.sh
	$(MAKE) lint
	scripts/run-tests

# Static checks on guardian/: ruff (lint and format), mypy --strict (settings in pyproject.toml),
# and the shape limits of a function (scripts/check-shape: 60 lines, 6 parameters).
lint:
	.venv/bin/ruff check guardian
	.venv/bin/ruff format --check guardian
	.venv/bin/mypy
	.venv/bin/python scripts/check-shape

# The static checks and the pure tests only (no container, no root), on 4 pytest-xdist workers (the
# tests mostly wait on local servers and timers): quick feedback while editing.
unit: lint
	.venv/bin/python -m pytest -q -n 4 -m "not system"

# The core's decisions against an earlier tree's, on seeded scenarios (scripts/differential-fuzz: the
# base revision is its --base; it needs the git history). For a change of the core's shape.
fuzz:
	scripts/differential-fuzz

# guardian_<version>_arm64.deb (DGX OS: Ubuntu 24.04, Python 3.12) and _amd64.deb (Debian 12) in dist/
deb:
	scripts/setup.sh
	.venv/bin/python packaging/build_deb.py --target all --out dist

# Re-pin the bundled Python dependencies (packaging/lock/<target>.txt, versions and sha256 hashes)
# from pyproject.toml's list: after changing a dependency, or to take newer releases. Commit the result.
lock:
	python3 packaging/lock.py
