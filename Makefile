# The two commands of the README. Both need root (they boot a container with systemd-nspawn).
.PHONY: demo test unit deb

demo:
	scripts/setup.sh
	.venv/bin/python demo/demo.py

test:
	scripts/setup.sh
	scripts/run-tests

# The pure tests only (no container, no root): quick feedback while editing.
unit:
	.venv/bin/python -m pytest -q -m "not system"

# guardian_<version>_arm64.deb (DGX OS: Ubuntu 24.04, Python 3.12) and _amd64.deb (Debian 12) in dist/
deb:
	scripts/setup.sh
	.venv/bin/python packaging/build_deb.py --target all --out dist
