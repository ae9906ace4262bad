//! What the provider offers, and which of it matches a caller's hints (safe Rust: the
//! boundary in `ffi` turns it into libfabric's structures).

/// Endpoint types (libfabric's `enum fi_ep_type` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpType {
    /// Reliable datagrams: connectionless, addressed through an address vector.
    Rdm,
    /// Connected endpoints with a connection manager (the VIA-style interface).
    Msg,
}

/// Capability bits (libfabric's `FI_*` capability flags).
pub mod caps {
    pub const MSG: u64 = 1 << 1;
    pub const RMA: u64 = 1 << 2;
    pub const TAGGED: u64 = 1 << 3;
    pub const READ: u64 = 1 << 8;
    pub const WRITE: u64 = 1 << 9;
    pub const RECV: u64 = 1 << 10;
    pub const SEND: u64 = 1 << 11;
    pub const REMOTE_READ: u64 = 1 << 12;
    pub const REMOTE_WRITE: u64 = 1 << 13;
    pub const DIRECTED_RECV: u64 = 1 << 59;
    pub const SOURCE: u64 = 1 << 57;
    pub const LOCAL_COMM: u64 = 1 << 51;
    pub const REMOTE_COMM: u64 = 1 << 52;
}

/// One thing offered: an endpoint type and its capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    pub ep_type: EpType,
    pub caps: u64,
    /// Largest message.
    pub max_msg_size: u64,
    /// Bytes sent inline (no completion needed to reuse the buffer).
    pub inject_size: u64,
}

/// Everything the provider offers, best first: reliable datagrams (with tagged messages),
/// then connected endpoints.
pub fn all() -> [Offer; 2] {
    use caps::*;
    let common = MSG | SEND | RECV | RMA | READ | WRITE | REMOTE_READ | REMOTE_WRITE | LOCAL_COMM | REMOTE_COMM;
    [
        Offer {
            ep_type: EpType::Rdm,
            caps: common | TAGGED | DIRECTED_RECV | SOURCE,
            max_msg_size: crate::rdm::MAX_MSG as u64,
            inject_size: 64,
        },
        Offer { ep_type: EpType::Msg, caps: common, max_msg_size: crate::rdm::MAX_MSG as u64, inject_size: 64 },
    ]
}

/// What a caller asked for (`fi_info` hints), as far as matching goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hints {
    /// None: any endpoint type.
    pub ep_type: Option<EpType>,
    /// Capabilities wanted (0: any).
    pub caps: u64,
    /// A provider name was given and it is not ours.
    pub other_provider: bool,
    /// A fabric name was given and it is not ours.
    pub other_fabric: bool,
}

/// The offers that satisfy `h` (the caller's capabilities narrowed to what it asked, when it
/// asked).
pub fn matching(h: &Hints) -> Vec<Offer> {
    if h.other_provider || h.other_fabric {
        return Vec::new();
    }
    all()
        .into_iter()
        .filter(|o| h.ep_type.is_none_or(|t| t == o.ep_type))
        .filter(|o| o.caps & h.caps == h.caps)
        .map(|o| {
            if h.caps != 0 {
                Offer { caps: h.caps | (o.caps & (caps::LOCAL_COMM | caps::REMOTE_COMM)), ..o }
            } else {
                o
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_narrow_the_offers() {
        assert_eq!(matching(&Hints::default()).len(), 2);
        let msg = matching(&Hints { ep_type: Some(EpType::Msg), ..Hints::default() });
        assert_eq!(msg.len(), 1);
        assert_eq!(msg[0].caps & caps::TAGGED, 0, "no tagged messages on connected endpoints");
        let rdm = matching(&Hints { ep_type: Some(EpType::Rdm), ..Hints::default() });
        assert_eq!(rdm.len(), 1);
        assert_eq!(rdm[0].ep_type, EpType::Rdm);
        // Tagged messages are offered on RDM endpoints only.
        let tagged = matching(&Hints { caps: caps::TAGGED | caps::MSG, ..Hints::default() });
        assert_eq!(tagged.iter().map(|o| o.ep_type).collect::<Vec<_>>(), [EpType::Rdm]);
        assert_eq!(tagged[0].caps & caps::TAGGED, caps::TAGGED);
        // Asking for something we do not have (atomics: bit 4) gets nothing.
        assert!(matching(&Hints { caps: 1 << 4, ..Hints::default() }).is_empty());
        assert!(matching(&Hints { other_provider: true, ..Hints::default() }).is_empty());
    }
}
