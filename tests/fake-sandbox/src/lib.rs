//! A fake OpenSandbox Lifecycle server with a simulation mode
