"""Rendering deployment artifacts from a plan: script, compose, k8s, systemd."""
