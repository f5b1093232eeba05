//! Who is calling ([`Authenticator`], [`Caller`]) and what each route lets
//! them do ([`Access`], the per-route middleware [`authorize`]).

mod caller;
mod policy;

pub(crate) use caller::{Authenticator, Caller};
pub use policy::Access;
pub(crate) use policy::{authorize, RouteAuth};
