//! The secrets jetrunner's services share with nobody else: the keys forge tasks are sealed
//! with ([`Sealer`], held by the scheduler) and the key executor tokens are derived from
//! ([`TokenKey`], held by a backend's worker and checked by the facade). One crate, so the
//! facade, the intakes and the workers agree on both without depending on each other.

mod seal;
mod token;

pub use seal::{SealError, SealScope, Sealer};
pub use token::{BadTokenKey, TokenKey, token_hash};
