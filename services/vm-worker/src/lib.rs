//! jetrunner vm-worker: runs assignments in Kata microVMs taken from an OpenSandbox pool.
//! [`opensandbox`] is the Lifecycle API client, [`backend`] the `jr_worker::Backend` over it.

pub mod backend;
pub mod opensandbox;
pub mod service;
