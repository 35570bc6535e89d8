"""Locust load tests of attnserve (headless runner, mixes, answer check): see docs/loadtest.md."""
