//! Checks on request values, before anything reaches the store.

use std::net::Ipv6Addr;

use rdma_transport::coordinator::api::{
    is_valid_node_id, NodeRegistration, RangeRequest, RdmaEndpoint,
};

use crate::error::ApiError;

/// Pages and ranges are multiples of this.
pub(crate) const PAGE_SIZE_BYTES: u64 = 4096;

/// Longest accepted `tcp_addr` (a DNS name of 253 bytes and a port).
const MAX_TCP_ADDR_BYTES: usize = 260;

/// Longest accepted RDMA device name.
const MAX_DEVICE_NAME_BYTES: usize = 64;

pub(crate) fn node_id(id: &str) -> Result<(), ApiError> {
    if is_valid_node_id(id) {
        Ok(())
    } else {
        Err(ApiError::BadRequest(format!(
            "invalid node id {id:?}: use 1 to 64 characters of [A-Za-z0-9_.-], not . or .."
        )))
    }
}

pub(crate) fn registration(registration: &NodeRegistration) -> Result<(), ApiError> {
    tcp_addr(&registration.tcp_addr)?;
    if let Some(endpoint) = &registration.rdma {
        rdma_endpoint(endpoint)?;
    }
    Ok(())
}

/// `host:port`: a non-empty host of printable ASCII without spaces, and a
/// port of decimal digits from 1 to 65535 (what the OpenAPI pattern says).
fn tcp_addr(addr: &str) -> Result<(), ApiError> {
    let bad = |why: &str| {
        Err(ApiError::BadRequest(format!(
            "invalid tcp_addr {addr:?}: {why}"
        )))
    };
    if addr.len() > MAX_TCP_ADDR_BYTES {
        return bad("too long");
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return bad("expected host:port");
    };
    if host.is_empty() || !host.bytes().all(|b| b.is_ascii_graphic()) {
        return bad("the host must be printable ASCII without spaces");
    }
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return bad("port must be 1 to 65535");
    }
    match port.parse::<u16>() {
        Ok(port) if port != 0 => Ok(()),
        _ => bad("port must be 1 to 65535"),
    }
}

pub(crate) fn rdma_endpoint(endpoint: &RdmaEndpoint) -> Result<(), ApiError> {
    let bad = |why: String| {
        Err(ApiError::BadRequest(format!(
            "invalid RDMA endpoint: {why}"
        )))
    };
    let device_ok = !endpoint.device.is_empty()
        && endpoint.device.len() <= MAX_DEVICE_NAME_BYTES
        && endpoint
            .device
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/');
    if !device_ok {
        return bad(format!("bad device name {:?}", endpoint.device));
    }
    if endpoint.port == 0 {
        return bad("port numbers start at 1".to_owned());
    }
    if endpoint.gid.parse::<Ipv6Addr>().is_err() {
        return bad(format!(
            "gid {:?} is not in textual IPv6 form",
            endpoint.gid
        ));
    }
    Ok(())
}

/// Alignment, non-zero length and no `u64` overflow; then the owner's id.
pub(crate) fn range(request: &RangeRequest) -> Result<(), ApiError> {
    let bad = |why: &str| Err(ApiError::BadRequest(why.to_owned()));
    if request.gpa_start % PAGE_SIZE_BYTES != 0 {
        return bad("gpa_start must be 4096-aligned");
    }
    if request.remote_offset % PAGE_SIZE_BYTES != 0 {
        return bad("remote_offset must be 4096-aligned");
    }
    if request.length_bytes == 0 || request.length_bytes % PAGE_SIZE_BYTES != 0 {
        return bad("length_bytes must be a non-zero multiple of 4096");
    }
    if request
        .gpa_start
        .checked_add(request.length_bytes)
        .is_none()
    {
        return bad("gpa_start + length_bytes overflows u64");
    }
    if request
        .remote_offset
        .checked_add(request.length_bytes)
        .is_none()
    {
        return bad("remote_offset + length_bytes overflows u64");
    }
    node_id(&request.node_id)
}

/// A `{gpa_start}` path parameter: decimal or `0x` hex.
pub(crate) fn gpa_start(text: &str) -> Result<u64, ApiError> {
    u64_param("gpa_start", text)
}

/// The path or query parameter `name`, a decimal or `0x`-hex `u64`.
pub(crate) fn u64_param(name: &str, text: &str) -> Result<u64, ApiError> {
    parse_u64(text).ok_or_else(|| {
        ApiError::BadRequest(format!("{name} {text:?} is not a decimal or 0x-hex u64"))
    })
}

/// Parses a decimal or `0x`-prefixed hexadecimal `u64`; no sign, no spaces.
pub(crate) fn parse_u64(text: &str) -> Option<u64> {
    let (digits, radix) = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => (hex, 16),
        None => (text, 10),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_decimal_and_hex() {
        assert_eq!(parse_u64("0"), Some(0));
        assert_eq!(parse_u64("4096"), Some(4096));
        assert_eq!(parse_u64("0x1000"), Some(4096));
        assert_eq!(parse_u64("0XfFfF"), Some(0xffff));
        assert_eq!(parse_u64("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "0x",
            "+1",
            "-1",
            " 1",
            "1 ",
            "18446744073709551616",
            "0x1g",
            "abc",
        ] {
            assert_eq!(parse_u64(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tcp_addrs() {
        for good in ["127.0.0.1:7000", "host.example:1", "[::1]:65535", "h:0080"] {
            assert!(tcp_addr(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "host",
            ":80",
            "host:0",
            "host:65536",
            "host:x",
            "a b:80",
            "h\u{e9}te:80",
            "host:+80",
            "host: 80",
            "host:",
        ] {
            assert!(tcp_addr(bad).is_err(), "{bad}");
        }
    }

    fn request(gpa_start: u64, length_bytes: u64, remote_offset: u64) -> RangeRequest {
        RangeRequest {
            gpa_start,
            length_bytes,
            node_id: "n1".to_owned(),
            remote_offset,
            rdma: None,
            contents: Default::default(),
        }
    }

    #[test]
    fn ranges() {
        assert!(range(&request(0, 4096, 0)).is_ok());
        assert!(range(&request(u64::MAX - 8191, 4096, 0)).is_ok());
        // Its end, 2^64, does not fit in a u64.
        assert!(range(&request(u64::MAX - 4095, 4096, 0)).is_err());
        assert!(range(&request(1, 4096, 0)).is_err());
        assert!(range(&request(0, 4096, 1)).is_err());
        assert!(range(&request(0, 0, 0)).is_err());
        assert!(range(&request(0, 4095, 0)).is_err());
        assert!(range(&request(u64::MAX - 4095, 8192, 0)).is_err());
        assert!(range(&request(0, 8192, u64::MAX - 4095)).is_err());
    }
}
