# The two commands a new user needs (see README.md):
#   make lab   install the course into .venv, copy the labs into my-labs/ (first time only)
#              and open JupyterLab there
#   make test  install the course into .venv and run the whole test suite
# and four more:
#   make grade LAB=03  grade my-labs/03_*/ as a graded class's autograde would, hidden tests
#                      included, in a scratch copy (tools/grade.py); in the student release,
#                      which has no hidden tests, it runs the visible ones
#   make update   git pull, then bring new and changed labs into my-labs/ without touching the
#                 student's copies (tools/my_labs.py)
#   make pieces   for Lab 14: your functions from labs 03–09, out of my-labs/ into
#                 my-labs/14_capstone/exported_pieces.py (tools/my_labs.py export)
#   make release  the student release of a graded class (solutions/README.md): release/scaling-lab/
#                 and release/scaling-lab.tar.gz, built from the last commit
# Installing is skipped when requirements.txt and pyproject.toml have not changed.
# The test suite also needs the cluster tools (JupyterHub, SlurmSpawner, Ansible, linters) that
# cluster_setup/ pins; students never need them, so `make lab` leaves them out.

PYTHON ?= /usr/bin/python3
VENV := .venv
STAMP := $(VENV)/.installed
CLUSTER_STAMP := $(VENV)/.cluster-tools-installed
CLUSTER_REQUIREMENTS := cluster_setup/requirements-hub.txt cluster_setup/requirements-admin.txt
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

# Students' JupyterLab runs without nbgrader's instructor tools (Formgrader, Create Assignment)
# and its exchange panels: tools/jupyter-student-config/ turns them off.
STUDENT_JUPYTER := JUPYTER_CONFIG_PATH=$(CURDIR)/tools/jupyter-student-config
# What students get: no solutions/, tests/ (hidden tests), tools/grading/, nbgrader_config.py or
# cluster_setup/. bench/ ships (the labs, README and REFERENCES.md send students to
# bench/gpu_check.py and bench/allreduce_busbw.py), less the instructors' scripts that drive the
# hidden tests and the fakes or run the solutions, and overlap_and_bubbles.py, which measures
# what the tests check.
RELEASE := release/scaling-lab
RELEASED := labs lib slides tools ':(exclude)tools/grading' bench \
	':(exclude)bench/self_grade_every_lab.py' ':(exclude)bench/grading_on_any_machine.py' \
	':(exclude)bench/lab_run_times.py' \
	':(exclude)bench/overlap_and_bubbles.py' README.md REFERENCES.md requirements.txt \
	pyproject.toml Makefile .gitignore

.PHONY: lab test install cluster-tools update release grade pieces

install: $(STAMP)

# What cluster_setup/local needs (cluster_setup/README.md); `make test` installs it too.
cluster-tools: $(CLUSTER_STAMP)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python >= 3.10 is needed; run make with PYTHON=/path/to/python3.11")'
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

$(CLUSTER_STAMP): $(STAMP) $(CLUSTER_REQUIREMENTS)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(addprefix -r ,$(CLUSTER_REQUIREMENTS))
	touch $@

lab: $(STAMP)
	$(VENV)/bin/python tools/my_labs.py copy
	$(STUDENT_JUPYTER) $(VENV)/bin/jupyter lab --ServerApp.root_dir=my-labs $(ALLOW_ROOT)

update:
	git pull --ff-only
	$(MAKE) --no-print-directory install
	$(VENV)/bin/python tools/my_labs.py update

pieces: $(STAMP)
	$(VENV)/bin/python tools/my_labs.py export

# The lab's name is checked first (stdlib only), so a mistyped LAB fails before an install.
grade:
	@$(PYTHON) tools/grade.py --check-lab "$(LAB)"
	@$(MAKE) --no-print-directory --silent install
	@$(VENV)/bin/python tools/grade.py "$(LAB)"

release:
	rm -rf $(RELEASE) $(RELEASE).tar.gz
	mkdir -p $(RELEASE)
	git archive HEAD $(RELEASED) | tar -x -C $(RELEASE)
	tar -czf $(RELEASE).tar.gz -C $(dir $(RELEASE)) $(notdir $(RELEASE))
	@echo "student release: $(RELEASE)/ and $(RELEASE).tar.gz (from commit $$(git rev-parse --short HEAD))"

test: $(CLUSTER_STAMP)
	@test -d tests || { echo 'make test: the test suite is not part of the student release (it holds the hidden tests); make lab opens the labs'; exit 2; }
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)
