"""Tests of agent_server: real gRPC servers, real loopback providers, real bundles."""
