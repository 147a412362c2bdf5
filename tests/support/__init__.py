"""Helpers that more than one test module uses, each module named for what it holds.

A test module imports only these, tests/conftest.py and the stand-ins at the top of tests/
(ports, fakes, standin_hub, standin_vllm, stub_docker, dockerlib, slow_docker), never another
test module: a test file runs, moves or is deleted on its own (issue 47, "Tests stand alone";
tests/test_architecture.py checks it).
"""
