//! jetrunner pod-worker service
