//! A faithful fake Gitea/Forgejo RunnerService for tests, demo and benchmark
