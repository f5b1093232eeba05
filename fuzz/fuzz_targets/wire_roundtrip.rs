//! Every decoder of the page wire protocol, on any bytes: it never panics,
//! and whatever it accepts encodes back to bytes that decode to the same
//! value (decoding and encoding agree on every field).

#![no_main]

use libfuzzer_sys::fuzz_target;
use rdma_transport::wire::{
    decode_to_home, decode_to_node, encode_refusal, encode_to_home, encode_to_node, AuthRequest,
    Challenge, Header, HelloAck, HelloRequest, ToNodeFrame, HEADER_LEN,
};
use rdma_transport::{Page, PAGE_SIZE};

fn page_of(bytes: Option<&[u8]>) -> Option<Box<Page>> {
    bytes.map(|b| {
        let mut page = Box::new([0u8; PAGE_SIZE]);
        page.copy_from_slice(b);
        page
    })
}

/// `decode` accepted `bytes` as `value`: its encoding has the same length
/// and decodes to `value` again.
fn round_trips<T: PartialEq + std::fmt::Debug>(
    value: T,
    bytes: &[u8],
    encode: impl Fn(&T) -> Vec<u8>,
    decode: impl Fn(&[u8]) -> Option<T>,
) {
    let encoded = encode(&value);
    assert_eq!(
        encoded.len(),
        bytes.len(),
        "{value:?} encodes to another length"
    );
    assert_eq!(
        decode(&encoded).as_ref(),
        Some(&value),
        "{value:?} does not round-trip"
    );
}

/// An encoded frame's header, decoded, and its payload.
fn split_frame(frame: &[u8]) -> (Header, &[u8]) {
    let (head, payload) = frame.split_at(HEADER_LEN);
    let header = Header::decode_prefix(head)
        .expect("an encoded header")
        .expect("32 bytes");
    (header, payload)
}

fn coherence(bytes: &[u8]) {
    let Ok(Some(header)) = Header::decode_prefix(bytes) else {
        return;
    };
    let Some(payload) = bytes.get(HEADER_LEN..HEADER_LEN + header.payload_len()) else {
        return;
    };
    for bound_sums in [false, true] {
        if let Ok(frame) = decode_to_home(&header, payload, bound_sums) {
            let page = page_of(frame.page);
            let again = encode_to_home(frame.offset, &frame.msg, page.as_deref(), bound_sums);
            let (h, p) = split_frame(&again);
            assert_eq!(decode_to_home(&h, p, bound_sums), Ok(frame));
        }
        match decode_to_node(&header, payload, bound_sums) {
            Ok(ToNodeFrame::Msg(frame)) => {
                let page = page_of(frame.page);
                let again = encode_to_node(frame.offset, &frame.msg, page.as_deref(), bound_sums);
                let (h, p) = split_frame(&again);
                assert_eq!(
                    decode_to_node(&h, p, bound_sums),
                    Ok(ToNodeFrame::Msg(frame))
                );
            }
            Ok(ToNodeFrame::Refused { offset, status }) => {
                let again = encode_refusal(offset, status, bound_sums);
                let h = Header::decode(&again).expect("an encoded header");
                assert_eq!(
                    decode_to_node(&h, &[], bound_sums),
                    Ok(ToNodeFrame::Refused { offset, status })
                );
            }
            Err(_) => {}
        }
    }
}

fuzz_target!(|bytes: &[u8]| {
    if let Ok(Some(header)) = Header::decode_prefix(bytes) {
        let again = Header::decode(&header.encode()).expect("an encoded header decodes");
        assert_eq!(again, header);
        assert!(header.payload_len() <= rdma_transport::wire::MAX_PAYLOAD_BYTES as usize);
    }
    if let Some(v) = HelloRequest::decode(bytes) {
        round_trips(v, bytes, HelloRequest::encode, HelloRequest::decode);
    }
    if let Some(v) = Challenge::decode(bytes) {
        round_trips(v, bytes, Challenge::encode, Challenge::decode);
    }
    if let Some(v) = AuthRequest::decode(bytes) {
        round_trips(v, bytes, AuthRequest::encode, AuthRequest::decode);
    }
    if let Some(v) = HelloAck::decode(bytes) {
        round_trips(v, bytes, HelloAck::encode, HelloAck::decode);
    }
    coherence(bytes);
});
