//! A fake Kubernetes API server (Pods, Secrets, watch) with a simulation mode
