// go-check-evidence checks a cachewitness Merkle proof answer (a bundle's proofs/<pod>.jsonl, or
// the answer of GET /cache/evidence?proof=inclusion) with Go's own transparency-log packages,
// golang.org/x/mod/sumdb/note (C2SP signed notes) and golang.org/x/mod/sumdb/tlog (RFC 6962
// proofs): no code of cachewitness's. See docs/evidence.md.
//
//	go-check-evidence PUBLIC_KEY_BASE64 < proofs.jsonl
//
// It prints one line per checkpoint, inclusion and consistency proof checked, and exits 1 when
// any fails. Builds with Debian's golang-go and golang-golang-x-mod-dev (GO111MODULE=off,
// GOPATH=/usr/share/gocode), or in a module requiring golang.org/x/mod.
package main

import (
	"bufio"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

type entry struct {
	EventType     string   `json:"event_type"`
	File          string   `json:"file"`
	Seq           int64    `json:"seq"`
	TreeSize      int64    `json:"tree_size"`
	Line          string   `json:"line"`
	LeafIndex     int64    `json:"leaf_index"`
	CheckpointSeq int64    `json:"checkpoint_seq"`
	AuditPath     []string `json:"audit_path"`
	FromSeq       int64    `json:"from_seq"`
	ToSeq         int64    `json:"to_seq"`
	FromSize      int64    `json:"from_size"`
	ToSize        int64    `json:"to_size"`
	// "inclusion" on the file's marker line, the hashes on a consistency proof's.
	Proof json.RawMessage `json:"proof"`
}

type head struct {
	size int64
	root tlog.Hash
}

func hashes(texts []string) ([]tlog.Hash, error) {
	out := make([]tlog.Hash, len(texts))
	for i, text := range texts {
		raw, err := hex.DecodeString(text)
		if err != nil || len(raw) != len(out[i]) {
			return nil, fmt.Errorf("not a hex SHA-256: %q", text)
		}
		copy(out[i][:], raw)
	}
	return out, nil
}

// checkpoint opens the checkpoint line's signed note with the key under the note's own origin.
func checkpoint(line string, key ed25519.PublicKey) (head, string, error) {
	var fields struct {
		Note string `json:"note"`
	}
	if err := json.Unmarshal([]byte(line), &fields); err != nil {
		return head{}, "", err
	}
	origin := strings.SplitN(fields.Note, "\n", 2)[0]
	vkey, err := note.NewEd25519VerifierKey(origin, key)
	if err != nil {
		return head{}, "", err
	}
	verifier, err := note.NewVerifier(vkey)
	if err != nil {
		return head{}, "", err
	}
	opened, err := note.Open([]byte(fields.Note), note.VerifierList(verifier))
	if err != nil {
		return head{}, "", err
	}
	lines := strings.Split(opened.Text, "\n")
	size, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil {
		return head{}, "", err
	}
	root, err := base64.StdEncoding.DecodeString(lines[2])
	if err != nil || len(root) != 32 {
		return head{}, "", fmt.Errorf("bad root %q", lines[2])
	}
	var h head
	h.size = size
	copy(h.root[:], root)
	return h, vkey, nil
}

func main() {
	raw, err := base64.StdEncoding.DecodeString(os.Args[1])
	if err != nil || len(raw) != ed25519.PublicKeySize {
		fmt.Fprintln(os.Stderr, "usage: go-check-evidence PUBLIC_KEY_BASE64 < proofs.jsonl")
		os.Exit(2)
	}
	key := ed25519.PublicKey(raw)
	heads := map[string]head{}
	failed := 0
	fail := func(format string, args ...any) {
		failed++
		fmt.Printf("FAIL "+format+"\n", args...)
	}
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 1<<24)
	for number := 1; scanner.Scan(); number++ {
		var e entry
		if err := json.Unmarshal(scanner.Bytes(), &e); err != nil {
			fail("%d: %v", number, err)
			continue
		}
		id := func(seq int64) string { return e.File + "#" + strconv.FormatInt(seq, 10) }
		switch e.EventType {
		case "cachewitness.checkpoint":
			h, vkey, err := checkpoint(e.Line, key)
			if err != nil || h.size != e.TreeSize {
				fail("%d: checkpoint %s: %v (size %d)", number, id(e.Seq), err, h.size)
				continue
			}
			heads[id(e.Seq)] = h
			fmt.Printf("ok %d: checkpoint %s: note verified by %s, tree %d\n", number, id(e.Seq), vkey, h.size)
		case "cachewitness.inclusion":
			h, found := heads[id(e.CheckpointSeq)]
			path, err := hashes(e.AuditPath)
			if !found || err != nil {
				fail("%d: inclusion: checkpoint %s held %v, %v", number, id(e.CheckpointSeq), found, err)
				continue
			}
			if err := tlog.CheckRecord(path, h.size, h.root, e.LeafIndex, tlog.RecordHash([]byte(e.Line))); err != nil {
				fail("%d: leaf %d of %d: %v", number, e.LeafIndex, h.size, err)
				continue
			}
			fmt.Printf("ok %d: leaf %d in tree %d (%d hashes)\n", number, e.LeafIndex, h.size, len(path))
		case "cachewitness.consistency":
			from, okFrom := heads[id(e.FromSeq)]
			to, okTo := heads[id(e.ToSeq)]
			var texts []string
			err := json.Unmarshal(e.Proof, &texts)
			var proof []tlog.Hash
			if err == nil {
				proof, err = hashes(texts)
			}
			if !okFrom || !okTo || err != nil {
				fail("%d: consistency %s -> %s: held %v %v, %v", number, id(e.FromSeq), id(e.ToSeq), okFrom, okTo, err)
				continue
			}
			if err := tlog.CheckTree(proof, to.size, to.root, from.size, from.root); err != nil {
				fail("%d: consistency %d -> %d: %v", number, from.size, to.size, err)
				continue
			}
			fmt.Printf("ok %d: tree %d is a prefix of tree %d\n", number, from.size, to.size)
		}
	}
	if failed > 0 {
		os.Exit(1)
	}
}
