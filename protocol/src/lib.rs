//! Specula's drafter protocol: wire types, version negotiation, tensor views and the drafter SDK.
