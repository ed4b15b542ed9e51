# The two commands of the README. Both need root (they boot a container with systemd-nspawn).
.PHONY: demo test unit

demo:
	scripts/setup.sh
	.venv/bin/python demo/demo.py

test:
	scripts/setup.sh
	scripts/run-tests

# The pure tests only (no container, no root): quick feedback while editing.
unit:
	.venv/bin/python -m pytest -q -m "not system"
