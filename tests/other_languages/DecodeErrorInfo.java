// Decodes a google.rpc.Status, as the agent server sends it in `grpc-status-details-bin`, with
// Java classes generated from this repository alone (tests/test_other_languages.py runs it).
import com.google.protobuf.Any;
import com.google.rpc.ErrorInfo;
import com.google.rpc.Status;
import java.nio.file.Files;
import java.nio.file.Path;
import rollout.agent.v1.StartThreadRequest;

public final class DecodeErrorInfo {
  public static void main(String[] args) throws Exception {
    Status status = Status.parseFrom(Files.readAllBytes(Path.of(args[0])));
    for (Any detail : status.getDetailsList()) {
      if (detail.is(ErrorInfo.class)) {
        ErrorInfo info = detail.unpack(ErrorInfo.class);
        System.out.println(status.getCode() + " " + info.getReason() + " " + info.getMetadataMap());
      }
    }
    // The service's own messages build too.
    System.out.println(StartThreadRequest.newBuilder().setModel("m").build().getModel());
  }
}
